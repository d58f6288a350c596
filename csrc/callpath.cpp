// The NVLink engine's repeated calls as whole C++ calls (built and loaded by commlib/cuda/callpath.py).
//
// Each entry point does, for a call that replays a kept launch, what the Python call path does
// (commlib/buffer.py _replay / _enter / _leave, commlib/backends/nvlink/engine.py plan_for / run_plan,
// _dispatch_replayed, get_dispatch_layout) with no Python frame in between: the checks that let the
// call replay, the comm stream's wait for the caller's stream, the outputs' allocations, the kept
// argument block patched with this call's addresses, cuLaunchKernel, the exit event. Where anything
// differs it returns None and the Python path runs the call, with every check.
//
// Only libc10 / libtorch / libtorch_python are linked: streams and events go through c10's device guard
// interface, cuLaunchKernel through dlsym of libcuda. So it builds and loads with a CPU-only torch too,
// where tests/test_callpath.py runs it against a recorder that stands in for the device.

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

using i64 = int64_t;
using u64 = uint64_t;
using Clock = std::chrono::steady_clock;
using Shape = std::vector<i64>;

// ------------------------------------------------------------------------------------------------
// Python objects the module uses (set once by _setup) and attribute names (interned at import)
// ------------------------------------------------------------------------------------------------

struct Globals {
  PyObject* loader = nullptr;        // commlib.cuda.loader's __dict__ (the kernel build a replay needs)
  PyObject* launch_error = nullptr;  // commlib.utils.errors.KernelLaunchError
  PyObject* overlap = nullptr;       // commlib.utils.event.EventOverlap
  PyObject* handle = nullptr;        // commlib.handle.DispatchHandle
  PyObject* config = nullptr;        // commlib.config.Config
  PyObject* event_base = nullptr;    // torch._C._CudaEventBase (None without CUDA)
  PyObject* raw_stream = nullptr;    // torch._C._cuda_getCurrentRawStream
  PyObject* capturing = nullptr;     // torch._C._cuda_isCurrentStreamCapturing
  int hc_bad_me = 1, hc_bad_rank = 2, hc_sent = 4, hc_recv = 12, hc_sig_rank = 20, hc_expert = 28;
  bool ready = false;
};
Globals G;

#define CALLPATH_NAMES(X)                                                                                     \
  X(backend) X(failed) X(_base) X(_ring_channels) X(_ce) X(counters) X(replayed) X(_host_seq) X(last_wait_ns) \
  X(_destroyed) X(buffer_id) X(_configs) X(num_sms) X(num_max_nvl_chunked_send_tokens)                        \
  X(num_max_nvl_chunked_recv_tokens) X(num_max_rdma_chunked_send_tokens) X(num_max_rdma_chunked_recv_tokens)   \
  X(extra) X(cpp_plans) X(event) X(extra_tensors) X(cuda_event) X(_layout_plans) X(local_rows)                \
  X(intranode_rows) X(num_tokens) X(__dict__) X(wait_event) X(send_counts) X(recv_counts) X(dispatch)        \
  X(combine) X(bf16) X(fp8) X(_variant_key) X(_recording) X(_fast_launch) X(_plain_mode) X(rank_prefix_matrix) \
  X(channel_prefix_matrix) X(recv_channel_prefix_matrix) X(recv_src_idx) X(is_token_in_rank) X(send_head)     \
  X(num_recv_tokens) X(_raise_bad_ids) X(count_wait_failed) X(layout) X(cached)

struct Names {
#define CALLPATH_DECLARE(n) PyObject* n = nullptr;
  CALLPATH_NAMES(CALLPATH_DECLARE)
#undef CALLPATH_DECLARE
};
Names* N = nullptr;

void intern_names() {
  N = new Names();
#define CALLPATH_INTERN(n)                          \
  N->n = PyUnicode_InternFromString(#n);            \
  if (!N->n) throw py::error_already_set();
  CALLPATH_NAMES(CALLPATH_INTERN)
#undef CALLPATH_INTERN
}

py::object attr(py::handle o, PyObject* name) {
  PyObject* r = PyObject_GetAttr(o.ptr(), name);
  if (!r) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(r);
}

void set_attr(py::handle o, PyObject* name, py::handle value) {
  if (PyObject_SetAttr(o.ptr(), name, value.ptr()) < 0) throw py::error_already_set();
}

bool truthy(py::handle o) {
  int r = PyObject_IsTrue(o.ptr());
  if (r < 0) throw py::error_already_set();
  return r == 1;
}

// An exact int (not a bool) that fits 64 bits, into *out.
bool exact_int(py::handle o, i64* out) {
  if (!PyLong_CheckExact(o.ptr())) return false;
  int overflow = 0;
  long long v = PyLong_AsLongLongAndOverflow(o.ptr(), &overflow);
  if (overflow || (v == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return false;
  }
  *out = v;
  return true;
}

i64 as_int(py::handle o) {
  long long v = PyLong_AsLongLong(o.ptr());
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  return v;
}

py::object int_obj(i64 v) { return py::reinterpret_steal<py::object>(PyLong_FromLongLong(v)); }

bool is_tensor(py::handle o) { return THPVariable_Check(o.ptr()); }
bool is_exact_tensor(py::handle o) { return Py_TYPE(o.ptr()) == reinterpret_cast<PyTypeObject*>(THPVariableClass); }
const at::Tensor& tensor(py::handle o) { return THPVariable_Unpack(o.ptr()); }
py::object wrap(at::Tensor t) { return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(t))); }
u64 address(const at::Tensor& t) { return reinterpret_cast<u64>(t.data_ptr()); }
bool same_shape(const at::Tensor& t, const Shape& s) { return t.sizes() == c10::IntArrayRef(s); }

// A contiguous ``shape`` tensor of ``dtype`` over ``block``'s storage from byte ``offset`` (a multiple
// of its item size): its own TensorImpl holding the storage, made without the dispatcher (view ops
// through it cost more host time than the allocation), not an autograd view, as at::empty's are not.
at::Tensor carve(const at::Tensor& block, i64 offset, c10::IntArrayRef shape, at::ScalarType dtype) {
  auto keys = c10::DispatchKeySet(block.is_cuda() ? c10::DispatchKey::CUDA : c10::DispatchKey::CPU);
  caffe2::TypeMeta meta = c10::scalarTypeToTypeMeta(dtype);
  const i64 size = static_cast<i64>(meta.itemsize());
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(block.storage()), keys, meta);
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  impl->set_sizes_contiguous(shape);
  impl->set_storage_offset(offset / size);
  TORCH_CHECK(offset % size == 0 && offset + t.numel() * size <= static_cast<i64>(block.storage().nbytes()),
              "commlib callpath: an output carved past its allocation (a bug in csrc/callpath.cpp)");
  return t;
}

i64 align_up(i64 n, i64 to) { return (n + to - 1) / to * to; }

// A new instance of a plain Python class, its __init__ skipped: the caller sets every attribute it has.
py::object bare_instance(PyObject* cls) {
  PyObject* o = PyType_GenericNew(reinterpret_cast<PyTypeObject*>(cls), nullptr, nullptr);
  if (!o) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(o);
}

// What EventOverlap(event, extra) makes (commlib/utils/event.py): ``extra`` a tuple or None.
py::object make_overlap(py::handle event, py::handle extra) {
  py::object o = bare_instance(G.overlap);
  set_attr(o, N->event, event);
  set_attr(o, N->extra_tensors, extra);
  return o;
}

// ------------------------------------------------------------------------------------------------
// The device: cuLaunchKernel from libcuda, or (tests) a recorder of every device operation
// ------------------------------------------------------------------------------------------------

using LaunchFn = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*, void**,
                         void**);
using ErrorNameFn = int (*)(int, const char**);
LaunchFn cu_launch = nullptr;
ErrorNameFn cu_error_name = nullptr;

py::list* recorder = nullptr;  // tests: device operations are appended here instead of issued
int recorder_launch_rc = 0;    // tests: the result the recorded cuLaunchKernel returns

std::string load_driver() {
  if (cu_launch) return "";
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* e = dlerror();
    return e ? e : "dlopen(libcuda.so.1) failed";
  }
  cu_error_name = reinterpret_cast<ErrorNameFn>(dlsym(lib, "cuGetErrorName"));
  cu_launch = reinterpret_cast<LaunchFn>(dlsym(lib, "cuLaunchKernel"));
  return cu_launch ? "" : "libcuda.so.1 has no cuLaunchKernel";
}

void record(py::tuple entry) {
  if (recorder) recorder->append(std::move(entry));
}

[[noreturn]] void launch_failed(int rc) {
  const char* name = nullptr;
  if (cu_error_name) cu_error_name(rc, &name);
  std::string msg = std::string("cuLaunchKernel failed: ") + (name ? name : "?") + " (" + std::to_string(rc) + ")";
  PyObject* exc = PyObject_CallFunction(G.launch_error, "si", msg.c_str(), rc);
  if (exc) {
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc)), exc);
    Py_DECREF(exc);
  }
  throw py::error_already_set();
}

inline void cpu_pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// ------------------------------------------------------------------------------------------------
// Opt-in per-phase host timing (_phases: benchmarks.bench_host prints it): off, a mark is one branch
// ------------------------------------------------------------------------------------------------

struct PhaseTimes {
  const char* op;
  const char* name;
  std::vector<u64> ns;  // one per mark
};
bool phases_on = false;
std::vector<PhaseTimes> phase_times;

// The time since the previous mark (or the call's start) is one sample of phase ``name`` of ``op``.
struct Phases {
  const char* op;
  Clock::time_point last;
  explicit Phases(const char* op_) : op(op_) {
    if (phases_on) last = Clock::now();
  }
  void mark(const char* name) {
    if (!phases_on) return;
    auto now = Clock::now();
    u64 ns = std::chrono::duration_cast<std::chrono::nanoseconds>(now - last).count();
    last = now;
    for (auto& p : phase_times)
      if (p.op == op && p.name == name) {
        if (p.ns.size() < 100000) p.ns.push_back(ns);
        return;
      }
    phase_times.push_back({op, name, {ns}});
  }
};

// ------------------------------------------------------------------------------------------------
// Launch: one kept kernel launch, its packed argument block patched in place per call
// ------------------------------------------------------------------------------------------------

struct Launch {
  u64 fn;
  unsigned grid, block, smem;
  std::string codes;               // struct codes of the kernel's parameters (commlib.cuda.loader)
  std::vector<std::string> names;  // their names in csrc/*.cu
  std::vector<size_t> offsets;     // byte offset of each inside the block
  std::vector<u64> store;          // the block (8-byte aligned)
  std::vector<void*> params;       // cuLaunchKernel's kernelParams
  size_t nbytes;
  py::object variant;              // loader._variant_key when it was made
  bool plain;

  Launch(u64 fn_, unsigned grid_, unsigned block_, unsigned smem_, std::string codes_, std::vector<std::string> names_,
         std::vector<size_t> offsets_, py::bytes packed, py::object variant_, bool plain_)
      : fn(fn_), grid(grid_), block(block_), smem(smem_), codes(std::move(codes_)), names(std::move(names_)),
        offsets(std::move(offsets_)), variant(std::move(variant_)), plain(plain_) {
    std::string bytes = packed;
    nbytes = bytes.size();
    if (names.size() != codes.size() || offsets.size() != codes.size())
      throw std::invalid_argument("Launch: codes, names and offsets differ in length");
    store.assign(nbytes / 8 + 1, 0);
    std::memcpy(store.data(), bytes.data(), nbytes);
    char* base = reinterpret_cast<char*>(store.data());
    for (size_t i = 0; i < codes.size(); ++i) {
      if (offsets[i] + width(codes[i]) > nbytes) throw std::invalid_argument("Launch: argument past the block");
      params.push_back(base + offsets[i]);
    }
  }

  static size_t width(char code) { return (code == 'Q' || code == 'q' || code == 'd') ? 8 : 4; }

  // The position of parameter ``name``, whose struct code must be ``code`` ('Q': a pointer or u64, 'i': int).
  int slot(const std::string& name, char code) const {
    for (size_t i = 0; i < names.size(); ++i) {
      if (names[i] != name) continue;
      if (codes[i] != code)
        throw std::invalid_argument("kernel parameter " + name + " has struct code " + codes[i] + ", expected " + code);
      return static_cast<int>(i);
    }
    throw std::invalid_argument("the kernel has no parameter " + name);
  }

  void set(int slot, u64 v) { std::memcpy(params[slot], &v, 8); }
  void set_i32(int slot, int32_t v) { std::memcpy(params[slot], &v, 4); }
  u64 get(int slot) const {
    u64 v;
    std::memcpy(&v, params[slot], 8);
    return v;
  }

  // Still what commlib.cuda.loader.launch would run (loader.Replay.current): the same kernel build and
  // load / store mode, the driver's launch path on, no record_launches block open.
  bool current() const {
    PyObject* d = G.loader;
    if (PyDict_GetItem(d, N->_variant_key) != variant.ptr()) return false;
    if (PyDict_GetItem(d, N->_recording) != Py_None) return false;
    PyObject* fast = PyDict_GetItem(d, N->_fast_launch);
    if (!fast || PyObject_IsTrue(fast) != 1) return false;
    PyObject* pm = PyDict_GetItem(d, N->_plain_mode);
    return pm && (PyObject_IsTrue(pm) == 1) == plain;
  }

  void issue(u64 stream) {
    if (recorder) {
      record(py::make_tuple("launch", fn, stream, grid, block, smem, py::bytes(bytes())));
      if (recorder_launch_rc) launch_failed(recorder_launch_rc);
      return;
    }
    if (!cu_launch) throw std::runtime_error("callpath: no CUDA driver to launch with (tests: _record(True) first)");
    int rc = cu_launch(reinterpret_cast<void*>(fn), grid, 1, 1, block, 1, 1, smem, reinterpret_cast<void*>(stream),
                       params.data(), nullptr);
    if (rc) launch_failed(rc);
  }

  std::string bytes() const { return std::string(reinterpret_cast<const char*>(store.data()), nbytes); }
};

using LaunchP = std::shared_ptr<Launch>;

// A cached dispatch's or a combine's kept launch (engine.py CachedPlan), kept on its handle.
struct CachedPlan {
  PyObject* owner;  // the backend that made it (identity only, never dereferenced)
  LaunchP launch;
  int kind;         // 0 cached dispatch, 1 combine
  i64 key;          // dispatch: x's dtype; combine: the weights' columns
  at::ScalarType dtype;
  Shape shape, second_shape, out_shape, out2_shape;
  bool has_second;
  i64 out2_offset = 0, out2_bytes = 0;  // the second output's place in the outputs' one allocation
  at::ScalarType out_dtype;
  i64 cfg[3];       // num_sms, num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens
  i64 channels;
  std::vector<std::pair<py::object, py::object>> fields;  // (handle attribute, the tensor the launch points at)
  i64 local_rows, remote_rows;
  int x_slot, second_slot = -1, out_slot, out2_slot = -1;
};

struct PlanSet {
  std::vector<std::shared_ptr<CachedPlan>> plans;
  void add(std::shared_ptr<CachedPlan> p) {
    for (auto& q : plans)
      if (q->kind == p->kind && q->key == p->key) {
        q = std::move(p);
        return;
      }
    plans.push_back(std::move(p));
  }
  CachedPlan* find(int kind, i64 key) const {
    for (auto& q : plans)
      if (q->kind == kind && q->key == key) return q.get();
    return nullptr;
  }
};

// The layout kernel's kept launch (engine.py _layout_plans).
struct LayoutPlan {
  LaunchP launch;
  int topk, ntpr, ntpe, tir;
  explicit LayoutPlan(LaunchP l)
      : launch(std::move(l)),
        topk(launch->slot("topk_idx", 'Q')),
        ntpr(launch->slot("num_tokens_per_rank", 'Q')),
        ntpe(launch->slot("num_tokens_per_expert", 'Q')),
        tir(launch->slot("is_token_in_rank", 'Q')) {}
};

// A non-cached dispatch's two kept launches (engine.py FullPlan).
struct FullTwin {
  LaunchP notify, dispatch;
  py::object sig;  // the call signature words the ranks compare (engine.py NOTIFY_SIG_FIELDS)
  i64 L, C, E;
  // notify's and dispatch's per-call parameters
  int n_tir, n_ntpr, n_ntpe, n_topk, n_cpm, n_rpm, n_rcp, n_counts, n_seq, n_flag;
  int d_x, d_scales, d_topk, d_w, d_tir, d_rpm, d_cpm, d_rcp, d_recv_x, d_recv_scales, d_src, d_recv_topk, d_recv_w,
      d_send_head, d_rows, d_abort;
  FullTwin(LaunchP n, LaunchP d, py::object sig_, i64 L_, i64 C_, i64 E_)
      : notify(std::move(n)), dispatch(std::move(d)), sig(std::move(sig_)), L(L_), C(C_), E(E_) {
    n_tir = notify->slot("is_token_in_rank", 'Q');
    n_ntpr = notify->slot("num_tokens_per_rank", 'Q');
    n_ntpe = notify->slot("num_tokens_per_expert", 'Q');
    n_topk = notify->slot("topk_idx", 'Q');
    n_cpm = notify->slot("channel_prefix_matrix", 'Q');
    n_rpm = notify->slot("rank_prefix_matrix", 'Q');
    n_rcp = notify->slot("recv_channel_prefix_matrix", 'Q');
    n_counts = notify->slot("host_counts", 'Q');
    n_seq = notify->slot("host_seq", 'Q');
    n_flag = notify->slot("host_flag", 'Q');
    d_x = dispatch->slot("x", 'Q');
    d_scales = dispatch->slot("x_scales", 'Q');
    d_topk = dispatch->slot("topk_idx", 'Q');
    d_w = dispatch->slot("topk_weights", 'Q');
    d_tir = dispatch->slot("is_token_in_rank", 'Q');
    d_rpm = dispatch->slot("rank_prefix_matrix", 'Q');
    d_cpm = dispatch->slot("channel_prefix_matrix", 'Q');
    d_rcp = dispatch->slot("recv_channel_prefix_matrix", 'Q');
    d_recv_x = dispatch->slot("recv_x", 'Q');
    d_recv_scales = dispatch->slot("recv_x_scales", 'Q');
    d_src = dispatch->slot("recv_src_idx", 'Q');
    d_recv_topk = dispatch->slot("recv_topk_idx", 'Q');
    d_recv_w = dispatch->slot("recv_topk_weights", 'Q');
    d_send_head = dispatch->slot("send_head", 'Q');
    d_rows = dispatch->slot("num_out_rows", 'i');
    d_abort = dispatch->slot("abort_word", 'Q');
  }
};

// What Buffer._check_dispatch reads of a tensor argument (buffer.py _tensor_signature).
struct Sig {
  bool present = false;
  at::ScalarType dtype = at::kByte;
  Shape shape;
  bool contiguous = false;
  i64 device = -1;
};

Sig sig_of(py::handle o) {
  Sig s;
  if (o.is_none()) return s;
  const at::Tensor& t = tensor(o);
  s.present = true;
  s.dtype = t.scalar_type();
  s.shape = t.sizes().vec();
  s.contiguous = t.is_contiguous();
  s.device = t.get_device();
  return s;
}

// ``o`` has signature ``s`` (None for an absent one; else exactly a torch.Tensor). ``strides``: compare
// contiguity too (FP8 scales take any strides).
bool matches(const Sig& s, py::handle o, bool strides = true) {
  if (!s.present) return o.is_none();
  if (!is_exact_tensor(o)) return false;
  const at::Tensor& t = tensor(o);
  return t.scalar_type() == s.dtype && t.sizes() == c10::IntArrayRef(s.shape) &&
         (!strides || t.is_contiguous() == s.contiguous) && t.get_device() == s.device;
}

// A non-cached dispatch the Python path ran: its arguments' signature and the launches it kept.
struct FullEntry {
  bool x_tuple;
  Sig x, scales, ntpr, nrr, tir, ntpe, topk, w;
  i64 alignment, worst;
  py::object config;  // the Config, or None (then num_sms: Buffer.num_sms)
  i64 cfg[5] = {0, 0, 0, 0, 0};
  i64 num_sms = -1;
  std::shared_ptr<FullTwin> twin;
  i64 T, H, S, Kk;
  py::object handle_template;  // the handle's __dict__ with the per-call fields cleared
};

const char* const kHandleCallFields[] = {"rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix",
                                         "recv_src_idx", "is_token_in_rank", "send_head", "num_recv_tokens", "extra"};

// ------------------------------------------------------------------------------------------------
// Engine: one Buffer's comm stream, events and kept non-cached dispatches
// ------------------------------------------------------------------------------------------------

struct Stream {
  c10::Stream c;
  u64 raw;
};

struct Engine {
  bool test;                 // no device: operations go to the recorder, tensors live on the CPU
  i64 dev;                   // the Buffer's CUDA device index (-1 in tests)
  i64 rank, R;
  u64 timeout_ns;
  c10::Device device{c10::kCPU};
  Stream comm{c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::kCPU)), 0};
  py::object comm_obj;       // the torch.cuda.Stream
  void* entry_event;         // Buffer._entry_event's cudaEvent_t (see Buffer._enter)
  py::object buffer_type;    // the Buffer class (its num_sms)
  py::object new_event;      // () -> (a torch.cuda.Event recorded once, its cudaEvent_t)
  const c10::impl::DeviceGuardImplInterface* impl = nullptr;
  std::vector<std::pair<py::object, u64>> pool;  // exit events; one only the pool holds is free again
  size_t pool_at = 0;
  std::vector<std::shared_ptr<FullEntry>> full;
  u64 test_stream = 1;       // tests: the caller's (current) stream
  u64 alloc_stream = 0;      // tests: the stream allocations are made on (0: the current one)
  enum Op { kLayout, kCached, kCombine, kDispatch, kOps };
  i64 served_n[kOps] = {0, 0, 0, 0};  // calls served here, per op (``served``)

  explicit Engine(py::dict s) {
    if (!G.ready) throw std::runtime_error("callpath: _setup was not called");
    test = s["test"].cast<bool>();
    dev = s["device_index"].cast<i64>();
    rank = s["rank"].cast<i64>();
    R = s["num_ranks"].cast<i64>();
    timeout_ns = s["timeout_ns"].cast<u64>();
    buffer_type = s["buffer_type"];
    new_event = s["new_event"];
    comm_obj = s["comm_stream"];
    entry_event = reinterpret_cast<void*>(s["entry_event"].cast<u64>());
    if (test) {
      comm.raw = s["comm_raw"].cast<u64>();
      return;
    }
    std::string missing = load_driver();
    if (!missing.empty()) throw std::runtime_error("callpath: no CUDA driver: " + missing);
    device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(dev));
    impl = c10::impl::getDeviceGuardImpl(c10::kCUDA);
    comm.c = c10::Stream::unpack3(comm_obj.attr("stream_id").cast<i64>(), static_cast<c10::DeviceIndex>(dev),
                                  c10::kCUDA);
    comm.raw = comm_obj.attr("cuda_stream").cast<u64>();
  }

  // ---------------------------------------------------------------- streams and events
  Stream current() const {
    if (test) return Stream{c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::kCPU)), test_stream};
    return Stream{impl->getStream(device), 0};
  }

  u64 current_raw() const {
    if (test) return test_stream;
    py::object r = py::reinterpret_steal<py::object>(PyObject_CallOneArg(G.raw_stream, int_obj(dev).ptr()));
    if (!r) throw py::error_already_set();
    return static_cast<u64>(as_int(r));
  }

  bool capturing() const {
    if (test) return false;
    py::object r = py::reinterpret_steal<py::object>(PyObject_CallNoArgs(G.capturing));
    if (!r) throw py::error_already_set();
    return truthy(r);
  }

  bool on_device() const {
    if (test) return true;
    return impl->getDevice().index() == dev;   // what torch.cuda.current_device() reads, with no Python call
  }

  void event_record(void* ev, const Stream& s) {
    if (test) return record(py::make_tuple("record", reinterpret_cast<u64>(ev), s.raw));
    void* e = ev;
    impl->record(&e, s.c, static_cast<c10::DeviceIndex>(dev), c10::EventFlag::PYTORCH_DEFAULT);
  }

  void event_wait(void* ev, const Stream& s) {
    if (test) return record(py::make_tuple("wait", reinterpret_cast<u64>(ev), s.raw));
    impl->block(ev, s.c);
  }

  void record_stream(const at::Tensor& t, const Stream& s) {
    if (test) return record(py::make_tuple("record_stream", address(t), s.raw));
    impl->recordDataPtrOnStream(t.storage().data_ptr(), s.c);
  }

  bool query(const Stream& s) const {
    if (test) return true;
    return impl->queryStream(s.c);
  }

  // Allocations on ``s`` until the guard ends (the comm stream's outputs; the caller's stream is current).
  struct AllocOn {
    Engine& e;
    bool on;
    c10::Stream prev{c10::Stream::DEFAULT, c10::Device(c10::kCPU)};
    u64 prev_raw = 0;
    AllocOn(Engine& e_, const Stream& s, bool on_) : e(e_), on(on_) {
      if (!on) return;
      if (e.test) {
        prev_raw = e.alloc_stream;
        e.alloc_stream = s.raw;
      } else {
        prev = e.impl->exchangeStream(s.c);
      }
    }
    ~AllocOn() {
      if (!on) return;
      if (e.test)
        e.alloc_stream = prev_raw;
      else
        e.impl->exchangeStream(prev);
    }
  };

  at::Tensor empty(const Shape& shape, at::ScalarType dtype) {
    at::Tensor t = at::empty(shape, at::TensorOptions().dtype(dtype).device(device));
    if (test)
      record(py::make_tuple("alloc", py::cast(shape), py::cast(dtype), alloc_stream ? alloc_stream : test_stream));
    return t;
  }

  std::pair<py::object, void*> exit_event() {
    size_t n = pool.size();
    for (size_t k = 0; k < n; ++k) {
      size_t i = (pool_at + k) % n;
      if (Py_REFCNT(pool[i].first.ptr()) == 1) {
        pool_at = (i + 1) % n;
        return {pool[i].first, reinterpret_cast<void*>(pool[i].second)};
      }
    }
    py::tuple made = new_event();
    py::object ev = made[0];
    u64 raw = made[1].cast<u64>();
    if (pool.size() < 64) pool.emplace_back(ev, raw);
    return {ev, reinterpret_cast<void*>(raw)};
  }

  // Buffer._enter: the comm stream waits for previous_event, or for the caller's stream. Returns
  // whether the outputs belong to the caller's stream.
  bool enter(const Stream& compute, py::handle prev, bool alloc_on_comm) {
    if (!prev.is_none()) {
      py::object ev = attr(prev, N->event);
      if (!ev.is_none()) {
        if (!test && G.event_base != Py_None &&
            PyObject_TypeCheck(ev.ptr(), reinterpret_cast<PyTypeObject*>(G.event_base))) {
          u64 raw = static_cast<u64>(as_int(attr(ev, N->cuda_event)));
          if (raw) event_wait(reinterpret_cast<void*>(raw), comm);  // an event never recorded: nothing to wait for
        } else {
          comm_obj.attr("wait_event")(ev);
        }
        return false;
      }
    }
    event_record(entry_event, compute);
    event_wait(entry_event, comm);
    return !alloc_on_comm;
  }

  // Buffer._leave: the allocator learns which streams use what; the exit event, waited for by the
  // caller's stream unless async_finish. ``inputs``: the call's tensor arguments (Python objects).
  py::object leave(const Stream& compute, const std::vector<at::Tensor>& blocks, const std::vector<py::handle>& inputs,
                   bool async_finish, bool on_compute) {
    if (async_finish)
      for (py::handle o : inputs) {
        const at::Tensor& t = tensor(o);
        if (t.is_cuda()) record_stream(t, comm);
      }
    if (on_compute) {
      if (async_finish)
        for (const at::Tensor& b : blocks) record_stream(b, comm);
    } else {
      for (const at::Tensor& b : blocks) record_stream(b, compute);
    }
    auto [ev, raw] = exit_event();
    event_record(raw, comm);
    if (!async_finish) event_wait(raw, compute);
    py::object extra = py::none();
    if (async_finish && !inputs.empty()) {
      py::tuple kept(inputs.size());
      for (size_t i = 0; i < inputs.size(); ++i) kept[i] = py::reinterpret_borrow<py::object>(inputs[i]);
      extra = std::move(kept);
    }
    return make_overlap(ev, extra);
  }

  // ---------------------------------------------------------------- shared checks and bookkeeping
  // The backend of ``buffer`` if it may serve a call: Buffer alive, backend not failed or destroyed.
  py::object live_backend(py::handle buffer) {
    if (truthy(attr(buffer, N->_destroyed))) return py::object();
    py::object backend = attr(buffer, N->backend);
    if (truthy(attr(backend, N->failed)) || attr(backend, N->_base).is_none()) return py::object();
    return backend;
  }

  // Buffer._resolve_config where it needs no Python: the Config given (when runnable), or the one a
  // call of this shape found before. Null: the Python path resolves it (and raises what it raises).
  py::object resolve_config(py::handle buffer, py::handle config, PyObject* kind, i64 T, i64 H, PyObject* dtype) {
    if (config.is_none()) {
      py::object key = py::make_tuple(py::handle(kind), T, H, py::handle(dtype), attr(buffer_type, N->num_sms));
      PyObject* hit = PyDict_GetItem(attr(buffer, N->_configs).ptr(), key.ptr());
      return hit ? py::reinterpret_borrow<py::object>(hit) : py::object();
    }
    if (!PyObject_TypeCheck(config.ptr(), reinterpret_cast<PyTypeObject*>(G.config))) return py::object();
    i64 n;
    if (!exact_int(attr(config, N->num_sms), &n) || n <= 0 || n % 2) return py::object();
    return py::reinterpret_borrow<py::object>(config);
  }

  static bool config_type_ok(py::handle config) {
    return config.is_none() || PyObject_TypeCheck(config.ptr(), reinterpret_cast<PyTypeObject*>(G.config));
  }

  bool ring_is(py::handle backend, i64 channels) {
    i64 c;
    return exact_int(attr(backend, N->_ring_channels), &c) && c == channels;
  }

  py::dict served() const {
    py::dict d;
    PyObject* names[kOps] = {N->layout, N->cached, N->combine, N->dispatch};
    for (int i = 0; i < kOps; ++i) d[py::handle(names[i])] = served_n[i];
    return d;
  }

  // The backend's counts of a replayed call (replayed, counters; a zero count left as it is).
  void count_call(py::handle backend, Op op, i64 local, i64 remote) {
    set_attr(backend, N->replayed, int_obj(as_int(attr(backend, N->replayed)) + 1));
    ++served_n[op];
    if (!local && !remote) return;
    py::object counters = attr(backend, N->counters);
    for (auto [key, add] : {std::pair<PyObject*, i64>{N->local_rows, local}, {N->intranode_rows, remote}}) {
      if (!add) continue;
      PyObject* cur = PyDict_GetItem(counters.ptr(), key);
      if (!cur) throw py::key_error("counters");
      if (PyDict_SetItem(counters.ptr(), key, int_obj(as_int(cur) + add).ptr()) < 0) throw py::error_already_set();
    }
  }

  // The calls' common gate (Buffer._replay): previous_event an EventOverlap or None, allocate_on_comm_stream
  // with its conditions, the Buffer's device current, no stream capture (captures take the full path).
  bool stream_args_ok(py::handle prev, bool async_finish, bool alloc_on_comm) {
    if (!prev.is_none() && !PyObject_TypeCheck(prev.ptr(), reinterpret_cast<PyTypeObject*>(G.overlap))) return false;
    if (alloc_on_comm && (prev.is_none() || !async_finish)) return false;
    return on_device() && !capturing();
  }

  // ---------------------------------------------------------------- cached dispatch and combine
  // engine.py plan_for: the kept plan of ``handle`` for this call, or null.
  CachedPlan* plan_for(py::handle backend, py::handle handle, int kind, i64 key, const at::Tensor& x,
                       py::handle cfg, py::handle second) {
    py::object extra = attr(handle, N->extra);
    if (!PyDict_Check(extra.ptr())) return nullptr;
    PyObject* set = PyDict_GetItem(extra.ptr(), N->cpp_plans);
    if (!set) return nullptr;
    CachedPlan* p = py::cast<PlanSet*>(py::handle(set))->find(kind, key);
    if (!p || p->owner != backend.ptr()) return nullptr;
    if (x.scalar_type() != p->dtype || !same_shape(x, p->shape) || x.get_device() != dev || !x.is_contiguous() ||
        (address(x) & 15))
      return nullptr;
    PyObject* cfg_fields[3] = {N->num_sms, N->num_max_nvl_chunked_send_tokens, N->num_max_nvl_chunked_recv_tokens};
    for (int i = 0; i < 3; ++i) {
      i64 v;
      if (!exact_int(attr(cfg, cfg_fields[i]), &v) || v != p->cfg[i]) return nullptr;
    }
    if (!ring_is(backend, p->channels) || !p->launch->current()) return nullptr;
    for (auto& f : p->fields)
      if (attr(handle, f.first.ptr()).ptr() != f.second.ptr()) return nullptr;
    if (!p->has_second) return second.is_none() ? p : nullptr;
    if (!is_tensor(second)) return nullptr;
    const at::Tensor& s = tensor(second);
    if (s.scalar_type() != at::kFloat || !same_shape(s, p->second_shape) || s.get_device() != dev ||
        !s.is_contiguous() || (address(s) & 15))
      return nullptr;
    return p;
  }

  // engine.py run_plan + Buffer._leave. Returns (first output, second output or None, EventOverlap).
  py::tuple run_cached(py::handle backend, CachedPlan& p, py::handle xo, py::handle second, py::handle prev,
                       bool async_finish, bool alloc_on_comm, Phases& ph) {
    Stream compute = current();
    bool on_compute = enter(compute, prev, alloc_on_comm);
    ph.mark("enter");
    std::vector<at::Tensor> blocks;
    at::Tensor out1, out2;
    {
      AllocOn guard(*this, comm, !on_compute);
      if (p.has_second) {  // one allocation, the second output at the first 256-byte boundary past the first
        blocks.push_back(empty({p.out2_offset + p.out2_bytes}, at::kByte));
        out1 = carve(blocks[0], 0, p.out_shape, p.out_dtype);
        out2 = carve(blocks[0], p.out2_offset, p.out2_shape, at::kFloat);
      } else {
        out1 = blocks.emplace_back(empty(p.out_shape, p.out_dtype));
      }
    }
    ph.mark("alloc");
    Launch& l = *p.launch;
    l.set(p.x_slot, address(tensor(xo)));
    l.set(p.out_slot, address(out1));
    if (p.has_second) {
      l.set(p.second_slot, address(tensor(second)));
      l.set(p.out2_slot, address(out2));
    }
    l.issue(comm.raw);
    ph.mark("launch");
    count_call(backend, p.kind ? kCombine : kCached, p.local_rows, p.remote_rows);
    ph.mark("count");
    std::vector<py::handle> inputs{xo};
    if (!second.is_none()) inputs.push_back(second);
    py::object overlap = leave(compute, blocks, inputs, async_finish, on_compute);
    ph.mark("leave");
    return py::make_tuple(wrap(std::move(out1)), p.has_second ? wrap(std::move(out2)) : py::none(), overlap);
  }

  // Buffer.dispatch(x, handle=handle, ...) replayed: the 6-tuple it returns, or None.
  py::object cached_dispatch(py::handle buffer, py::handle x, py::handle handle, py::handle alignment,
                             py::handle config, py::handle prev, bool async_finish, bool alloc_on_comm) {
    Phases ph("cached");
    i64 al;
    if (!exact_int(alignment, &al) || al <= 0) return py::none();
    if (Py_TYPE(handle.ptr()) != reinterpret_cast<PyTypeObject*>(G.handle)) return py::none();
    py::handle data = x, scales = py::none();
    if (!is_tensor(x)) {
      if (!PyTuple_CheckExact(x.ptr()) || PyTuple_GET_SIZE(x.ptr()) != 2) return py::none();
      data = PyTuple_GET_ITEM(x.ptr(), 0);
      scales = PyTuple_GET_ITEM(x.ptr(), 1);
      if (!is_tensor(data)) return py::none();
    }
    const at::Tensor& d = tensor(data);
    if (d.dim() != 2 || !config_type_ok(config)) return py::none();
    py::object backend = live_backend(buffer);
    if (!backend || !attr(handle, N->buffer_id).equal(attr(buffer, N->buffer_id))) return py::none();
    py::object cfg =
        resolve_config(buffer, config, N->dispatch, d.size(0), d.size(1), scales.is_none() ? N->bf16 : N->fp8);
    if (!cfg) return py::none();
    CachedPlan* p = plan_for(backend, handle, 0, static_cast<i64>(d.scalar_type()), d, cfg, scales);
    if (!p || !stream_args_ok(prev, async_finish, alloc_on_comm)) return py::none();
    ph.mark("checks");
    py::tuple out = run_cached(backend, *p, data, scales, prev, async_finish, alloc_on_comm, ph);
    py::object recv = scales.is_none() ? py::object(out[0]) : py::object(py::make_tuple(out[0], out[1]));
    py::object result = py::make_tuple(recv, py::none(), py::none(), py::none(), handle, out[2]);
    ph.mark("result");
    return result;
  }

  // Buffer.combine(x, handle, topk_weights, ...) replayed (no bias, finish_later False): its 3-tuple, or None.
  py::object combine(py::handle buffer, py::handle x, py::handle handle, py::handle weights, py::handle config,
                     py::handle prev, bool async_finish, bool alloc_on_comm) {
    Phases ph("combine");
    if (Py_TYPE(handle.ptr()) != reinterpret_cast<PyTypeObject*>(G.handle) || !is_tensor(x)) return py::none();
    const at::Tensor& xt = tensor(x);
    if (xt.dim() != 2 || !config_type_ok(config)) return py::none();
    i64 Kk = 0;
    if (!weights.is_none()) {
      if (!is_tensor(weights) || tensor(weights).dim() != 2) return py::none();
      Kk = tensor(weights).size(1);
    }
    py::object backend = live_backend(buffer);
    if (!backend || !attr(handle, N->buffer_id).equal(attr(buffer, N->buffer_id))) return py::none();
    i64 T;
    if (!exact_int(attr(handle, N->num_tokens), &T)) return py::none();
    py::object cfg = resolve_config(buffer, config, N->combine, T, xt.size(1), N->bf16);
    if (!cfg) return py::none();
    CachedPlan* p = plan_for(backend, handle, 1, Kk, xt, cfg, weights);
    if (!p || !stream_args_ok(prev, async_finish, alloc_on_comm)) return py::none();
    ph.mark("checks");
    py::tuple out = run_cached(backend, *p, x, weights, prev, async_finish, alloc_on_comm, ph);
    ph.mark("result");
    return out;
  }

  // ---------------------------------------------------------------- layout
  // Buffer.get_dispatch_layout(topk_idx, num_experts) on the caller's stream, replayed: its 5-tuple, or None.
  py::object layout(py::handle buffer, py::handle topk, py::handle experts) {
    Phases ph("layout");
    i64 E;
    if (!exact_int(experts, &E) || E <= 0 || E % R || (R + E) * 4 > 48 * 1024 || !is_tensor(topk)) return py::none();
    const at::Tensor& t = tensor(topk);
    if (t.scalar_type() != at::kLong || t.dim() != 2 || t.get_device() != dev || !t.is_contiguous()) return py::none();
    py::object backend = live_backend(buffer);
    if (!backend) return py::none();
    ph.mark("args");
    u64 stream = current_raw();
    ph.mark("stream");
    py::object key = py::make_tuple(stream, t.size(0), t.size(1), E);
    PyObject* kept = PyDict_GetItem(attr(backend, N->_layout_plans).ptr(), key.ptr());
    if (!kept || !PyTuple_Check(kept) || PyTuple_GET_SIZE(kept) < 3 || PyTuple_GET_ITEM(kept, 2) == Py_None)
      return py::none();
    LayoutPlan& p = *py::cast<LayoutPlan*>(py::handle(PyTuple_GET_ITEM(kept, 2)));
    if (!p.launch->current()) return py::none();
    ph.mark("plan");
    // one allocation, three tensors over it (is_token_in_rank first, the counts at 16-byte offsets):
    // one device operation instead of three
    const i64 T = t.size(0), o_ntpr = align_up(T * R, 16), o_ntpe = o_ntpr + align_up(R * 4, 16);
    at::Tensor block = empty({o_ntpe + align_up(E * 4, 16)}, at::kByte);
    ph.mark("alloc");
    at::Tensor tir = carve(block, 0, {T, R}, at::kBool);
    at::Tensor ntpr = carve(block, o_ntpr, {R}, at::kInt), ntpe = carve(block, o_ntpe, {E}, at::kInt);
    ph.mark("views");
    Launch& l = *p.launch;
    l.set(p.topk, address(t));
    l.set(p.ntpr, address(ntpr));
    l.set(p.ntpe, address(ntpe));
    l.set(p.tir, address(tir));
    l.issue(stream);
    ph.mark("launch");
    count_call(backend, kLayout, 0, 0);
    ph.mark("count");
    py::object out = py::make_tuple(wrap(ntpr), py::none(), wrap(ntpe), wrap(tir), make_overlap(py::none(), py::none()));
    ph.mark("result");
    return out;
  }

  // ---------------------------------------------------------------- non-cached dispatch
  struct DispatchArgs {
    py::handle x, data, scales, ntpr, nrr, tir, ntpe, topk, w, alignment, worst, config;
    bool x_tuple;
  };

  // The arguments' parts, or false where they are not what the C++ path takes (topk_idx given, x a
  // tensor or a (tensor, tensor) tuple, exact ints).
  static bool split(DispatchArgs& a) {
    if (is_tensor(a.x)) {
      a.data = a.x;
      a.scales = py::none();
      a.x_tuple = false;
    } else {
      if (!PyTuple_CheckExact(a.x.ptr()) || PyTuple_GET_SIZE(a.x.ptr()) != 2) return false;
      a.data = PyTuple_GET_ITEM(a.x.ptr(), 0);
      a.scales = PyTuple_GET_ITEM(a.x.ptr(), 1);
      a.x_tuple = true;
      if (!is_exact_tensor(a.scales)) return false;
    }
    i64 v;
    return is_exact_tensor(a.data) && !a.topk.is_none() && exact_int(a.alignment, &v) && exact_int(a.worst, &v);
  }

  bool config_matches(const FullEntry& e, py::handle config) const {
    if (config.is_none()) {
      i64 n;
      return e.config.is_none() && exact_int(attr(buffer_type, N->num_sms), &n) && n == e.num_sms;
    }
    if (config.ptr() != e.config.ptr()) return false;
    PyObject* fields[5] = {N->num_sms, N->num_max_nvl_chunked_send_tokens, N->num_max_nvl_chunked_recv_tokens,
                           N->num_max_rdma_chunked_send_tokens, N->num_max_rdma_chunked_recv_tokens};
    for (int i = 0; i < 5; ++i) {
      i64 v;
      if (!exact_int(attr(config, fields[i]), &v) || v != e.cfg[i]) return false;
    }
    return true;
  }

  std::shared_ptr<FullEntry> find_full(const DispatchArgs& a) {
    for (auto& e : full) {
      if (e->x_tuple != a.x_tuple || !matches(e->x, a.data)) continue;
      if (a.x_tuple && !matches(e->scales, a.scales, false)) continue;
      i64 al, worst;
      exact_int(a.alignment, &al);
      exact_int(a.worst, &worst);
      if (al != e->alignment || worst != e->worst) continue;
      if (!matches(e->ntpr, a.ntpr) || !matches(e->nrr, a.nrr) || !matches(e->tir, a.tir) ||
          !matches(e->ntpe, a.ntpe) || !matches(e->topk, a.topk) || !matches(e->w, a.w))
        continue;
      if (!config_matches(*e, a.config)) continue;
      return e;
    }
    return nullptr;
  }

  // Buffer.dispatch keeps a non-cached dispatch it ran with these arguments and the backend's launches
  // (``twin``; ``handle``: the handle it returned), so the next call like it runs here. False where the
  // call is not one the C++ path takes.
  bool keep_full(DispatchArgs a, std::shared_ptr<FullTwin> twin, py::handle handle) {
    if (!split(a)) return false;
    for (py::handle o : {a.ntpr, a.tir, a.ntpe, a.topk})
      if (!is_exact_tensor(o) || !tensor(o).is_contiguous()) return false;
    for (py::handle o : {a.nrr, a.w})
      if (!o.is_none() && (!is_exact_tensor(o) || !tensor(o).is_contiguous())) return false;
    if (!a.config.is_none() && Py_TYPE(a.config.ptr()) != reinterpret_cast<PyTypeObject*>(G.config)) return false;
    const at::Tensor& d = tensor(a.data);
    if (d.dim() != 2 || !d.is_contiguous()) return false;
    auto e = std::make_shared<FullEntry>();
    e->x_tuple = a.x_tuple;
    e->x = sig_of(a.data);
    e->T = d.size(0);
    e->H = d.size(1);
    e->S = 0;
    if (a.x_tuple) {
      const at::Tensor& s = tensor(a.scales);
      // the float32 [T, H / 128] scales the transports move as they are (validate.scales_carrier)
      if (s.scalar_type() != at::kFloat || s.dim() != 2 || s.size(1) != e->H / 128 || !s.is_contiguous()) return false;
      e->scales = sig_of(a.scales);
      e->S = s.size(1);
    }
    e->ntpr = sig_of(a.ntpr);
    e->nrr = sig_of(a.nrr);
    e->tir = sig_of(a.tir);
    e->ntpe = sig_of(a.ntpe);
    e->topk = sig_of(a.topk);
    e->w = sig_of(a.w);
    e->Kk = tensor(a.topk).size(1);
    exact_int(a.alignment, &e->alignment);
    exact_int(a.worst, &e->worst);
    e->config = py::reinterpret_borrow<py::object>(a.config);
    if (a.config.is_none()) {
      if (!exact_int(attr(buffer_type, N->num_sms), &e->num_sms)) return false;
    } else {
      PyObject* fields[5] = {N->num_sms, N->num_max_nvl_chunked_send_tokens, N->num_max_nvl_chunked_recv_tokens,
                             N->num_max_rdma_chunked_send_tokens, N->num_max_rdma_chunked_recv_tokens};
      for (int i = 0; i < 5; ++i)
        if (!exact_int(attr(a.config, fields[i]), &e->cfg[i])) return false;
    }
    if (e->ntpe.shape.size() != 1 || twin->E != e->ntpe.shape[0] || e->tir.shape.size() != 2 || e->tir.shape[1] != R)
      return false;
    e->twin = std::move(twin);
    py::dict tpl = py::reinterpret_steal<py::dict>(PyDict_Copy(attr(handle, N->__dict__).ptr()));
    for (const char* f : kHandleCallFields) tpl[f] = py::none();
    e->handle_template = tpl;
    for (auto& old : full)
      if (same_signature(*old, *e)) {
        old = e;
        return true;
      }
    if (full.size() >= 16) full.clear();
    full.push_back(std::move(e));
    return true;
  }

  static bool same_sig(const Sig& a, const Sig& b) {
    return a.present == b.present && a.dtype == b.dtype && a.shape == b.shape && a.contiguous == b.contiguous &&
           a.device == b.device;
  }

  static bool same_signature(const FullEntry& a, const FullEntry& b) {
    return a.x_tuple == b.x_tuple && same_sig(a.x, b.x) && same_sig(a.scales, b.scales) && same_sig(a.ntpr, b.ntpr) &&
           same_sig(a.nrr, b.nrr) && same_sig(a.tir, b.tir) && same_sig(a.ntpe, b.ntpe) && same_sig(a.topk, b.topk) &&
           same_sig(a.w, b.w) && a.alignment == b.alignment && a.worst == b.worst && a.config.ptr() == b.config.ptr() &&
           a.num_sms == b.num_sms && std::equal(a.cfg, a.cfg + 5, b.cfg);
  }

  // The host words of the count exchange once notify raised the flag to ``seq`` (engine.py _wait_counts).
  std::vector<int32_t> wait_counts(py::handle backend, const FullTwin& tw, u64 seq, size_t words) {
    volatile i64* flag = reinterpret_cast<volatile i64*>(tw.notify->get(tw.n_flag));
    const volatile int32_t* counts = reinterpret_cast<const volatile int32_t*>(tw.notify->get(tw.n_counts));
    auto t0 = Clock::now();
    int status = 0;  // 1: the stream finished without the flag; 2: past the timeout; 3: the stream's error
    std::exception_ptr error;
    if (static_cast<u64>(*flag) != seq) {
      py::gil_scoped_release unlocked;
      auto last_query = t0;
      const auto limit = std::chrono::nanoseconds(timeout_ns) + std::chrono::seconds(5);
      for (u64 spins = 1; static_cast<u64>(*flag) != seq; ++spins) {
        cpu_pause();
        if (spins & 1023) continue;
        auto now = Clock::now();
        if (now - last_query >= std::chrono::microseconds(200)) {
          last_query = now;
          bool done = false;
          try {
            done = query(comm);
          } catch (...) {
            error = std::current_exception();
            status = 3;
            break;
          }
          if (done && static_cast<u64>(*flag) != seq) {
            status = 1;
            break;
          }
        }
        if (now - t0 > limit) {
          status = 2;
          break;
        }
      }
    }
    std::atomic_thread_fence(std::memory_order_acquire);
    set_attr(backend, N->last_wait_ns,
             int_obj(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count()));
    if (status) {
      py::object err = py::none();
      if (status == 3) {
        torch::translate_exception_to_python(error);
        py::error_already_set raised;
        err = raised.value();
      }
      backend.attr(N->count_wait_failed)(seq, err, status == 1);
      throw std::runtime_error("count_wait_failed returned");  // it raises
    }
    std::vector<int32_t> host(words);
    for (size_t i = 0; i < words; ++i) host[i] = counts[i];
    return host;
  }

  // Buffer.dispatch(x, num_tokens_per_rank=..., topk_idx=..., ...) run here: its 6-tuple, or None.
  py::object dispatch(py::handle buffer, DispatchArgs a, py::handle prev, bool async_finish, bool alloc_on_comm) {
    if (full.empty() || !split(a)) return py::none();
    std::shared_ptr<FullEntry> found = find_full(a);   // held: a keep_dispatch may drop it from ``full``
    if (!found) return py::none();
    FullEntry& e = *found;
    FullTwin& tw = *e.twin;
    const at::Tensor& x = tensor(a.data);
    if (!x.is_contiguous() || (address(x) & 15) || (a.x_tuple && !tensor(a.scales).is_contiguous())) return py::none();
    py::object backend = live_backend(buffer);
    if (!backend || !tw.notify->current() || !tw.dispatch->current() || !ring_is(backend, tw.C)) return py::none();
    if (e.worst == 0 && !attr(backend, N->_ce).is_none()) return py::none();  // the copy engines take it
    if (!stream_args_ok(prev, async_finish, alloc_on_comm)) return py::none();

    const i64 T = e.T, H = e.H, L = tw.L, C = tw.C, worst = e.worst;
    const at::Tensor& tir = tensor(a.tir);
    const at::Tensor& topk = tensor(a.topk);
    Stream compute = current();
    bool on_compute = enter(compute, prev, alloc_on_comm);
    std::vector<at::Tensor> blocks;
    at::Tensor cpm, rpm, rcp, counts;
    {
      AllocOn guard(*this, comm, !on_compute);
      cpm = blocks.emplace_back(empty({R, C}, at::kInt));
      rpm = blocks.emplace_back(empty({R, R}, at::kInt));
      rcp = blocks.emplace_back(empty({R, C}, at::kInt));
      if (worst) counts = blocks.emplace_back(empty({G.hc_expert + L}, at::kInt));
    }
    Launch& n = *tw.notify;
    n.set(tw.n_tir, address(tir));
    n.set(tw.n_ntpr, address(tensor(a.ntpr)));
    n.set(tw.n_ntpe, address(tensor(a.ntpe)));
    n.set(tw.n_topk, address(topk));
    n.set(tw.n_cpm, address(cpm));
    n.set(tw.n_rpm, address(rpm));
    n.set(tw.n_rcp, address(rcp));
    u64 seq = 0;
    if (worst) {
      n.set(tw.n_counts, address(counts));
    } else {
      seq = static_cast<u64>(as_int(attr(backend, N->_host_seq)) % 0x7FFFFFFF + 1);
      set_attr(backend, N->_host_seq, int_obj(static_cast<i64>(seq)));
      n.set(tw.n_seq, seq);
    }
    n.issue(comm.raw);
    std::vector<int32_t> host;
    i64 rows = worst;
    if (!worst) {
      host = wait_counts(backend, tw, seq, static_cast<size_t>(G.hc_expert + L));
      if (host[G.hc_bad_me] != 0 || host[G.hc_bad_rank] >= 0 || host[G.hc_sig_rank] >= 0)
        backend.attr(N->_raise_bad_ids)(py::cast(host), tw.sig);  // raises where the exchange found a fault
      rows = host[0];
    }
    at::Tensor recv_x, recv_scales, src, send_head, recv_topk, recv_w;
    {
      AllocOn guard(*this, comm, !on_compute);
      recv_x = blocks.emplace_back(empty({rows, H}, x.scalar_type()));
      if (a.x_tuple) recv_scales = blocks.emplace_back(empty({rows, e.S}, at::kFloat));
      src = blocks.emplace_back(empty({rows}, at::kInt));
      send_head = blocks.emplace_back(empty({T, R}, at::kInt));
      recv_topk = blocks.emplace_back(empty({rows, e.Kk}, at::kLong));
      if (!a.w.is_none()) recv_w = blocks.emplace_back(empty({rows, e.Kk}, at::kFloat));
    }
    Launch& d = *tw.dispatch;
    d.set(tw.d_x, address(x));
    d.set(tw.d_scales, a.x_tuple ? address(tensor(a.scales)) : 0);
    d.set(tw.d_topk, address(topk));
    d.set(tw.d_w, a.w.is_none() ? 0 : address(tensor(a.w)));
    d.set(tw.d_tir, address(tir));
    d.set(tw.d_rpm, address(rpm));
    d.set(tw.d_cpm, address(cpm));
    d.set(tw.d_rcp, address(rcp));
    d.set(tw.d_recv_x, address(recv_x));
    d.set(tw.d_recv_scales, a.x_tuple ? address(recv_scales) : 0);
    d.set(tw.d_src, address(src));
    d.set(tw.d_recv_topk, address(recv_topk));
    d.set(tw.d_recv_w, a.w.is_none() ? 0 : address(recv_w));
    d.set(tw.d_send_head, address(send_head));
    d.set_i32(tw.d_rows, static_cast<int32_t>(rows));
    d.set(tw.d_abort, worst ? address(counts) + 4 * static_cast<u64>(G.hc_bad_rank) : 0);
    d.issue(comm.raw);

    // engine.py _dispatch_result: the handle, the per-expert counts, the rows moved
    py::list per_expert;
    py::dict extra;
    i64 local = 0, remote = 0;
    if (!worst) {
      py::list sent, got;
      for (i64 r = 0; r < R; ++r) {
        sent.append(host[G.hc_sent + r]);
        got.append(host[G.hc_recv + r]);
        (r == rank ? local : remote) += host[G.hc_sent + r];
      }
      extra[N->send_counts] = sent;
      extra[N->recv_counts] = got;
      for (i64 i = 0; i < L; ++i) {
        i64 c = host[G.hc_expert + i];
        per_expert.append(e.alignment == 1 ? c : (c + e.alignment - 1) / e.alignment * e.alignment);
      }
    }
    count_call(backend, kDispatch, local, remote);
    py::object h = bare_instance(G.handle);
    py::dict fields = py::reinterpret_steal<py::dict>(PyDict_Copy(e.handle_template.ptr()));
    fields[N->rank_prefix_matrix] = wrap(rpm);
    fields[N->channel_prefix_matrix] = wrap(cpm);
    fields[N->recv_channel_prefix_matrix] = wrap(rcp);
    fields[N->recv_src_idx] = wrap(src);
    fields[N->is_token_in_rank] = a.tir;
    fields[N->send_head] = wrap(send_head);
    fields[N->num_recv_tokens] = worst ? py::none() : int_obj(rows);
    fields[N->extra] = extra;
    set_attr(h, N->__dict__, fields);
    std::vector<py::handle> inputs{a.data};
    for (py::handle o : {a.scales, a.topk, a.w, a.tir})
      if (!o.is_none()) inputs.push_back(o);
    py::object overlap = leave(compute, blocks, inputs, async_finish, on_compute);
    py::object recv = a.x_tuple ? py::object(py::make_tuple(wrap(recv_x), wrap(recv_scales))) : wrap(recv_x);
    return py::make_tuple(recv, wrap(recv_topk), a.w.is_none() ? py::none() : wrap(recv_w), per_expert, h, overlap);
  }
};

std::shared_ptr<CachedPlan> make_cached_plan(py::handle owner, LaunchP launch, const std::string& kind,
                                             at::ScalarType dtype, Shape shape, py::object second_shape, Shape out_shape,
                                             at::ScalarType out_dtype, py::object out2_shape, std::vector<i64> cfg,
                                             i64 channels, py::list fields, i64 local_rows, i64 remote_rows) {
  auto p = std::make_shared<CachedPlan>();
  if (kind != "dispatch" && kind != "combine") throw std::invalid_argument("CachedPlan kind: dispatch or combine");
  if (cfg.size() != 3) throw std::invalid_argument("CachedPlan: config key of 3 ints");
  bool combine = kind == "combine";
  p->owner = owner.ptr();
  p->launch = std::move(launch);
  p->kind = combine ? 1 : 0;
  p->dtype = dtype;
  p->shape = std::move(shape);
  p->has_second = !second_shape.is_none();
  if (p->has_second != !out2_shape.is_none()) throw std::invalid_argument("CachedPlan: second input without output");
  if (p->has_second) {
    p->second_shape = second_shape.cast<Shape>();
    p->out2_shape = out2_shape.cast<Shape>();
  }
  p->key = combine ? (p->has_second ? p->second_shape.at(1) : 0) : static_cast<i64>(dtype);
  p->out_shape = std::move(out_shape);
  p->out_dtype = out_dtype;
  i64 n1 = c10::elementSize(out_dtype), n2 = 4;
  for (i64 d : p->out_shape) n1 *= d;
  for (i64 d : p->out2_shape) n2 *= d;
  p->out2_offset = align_up(n1, 256);
  p->out2_bytes = n2;
  std::copy(cfg.begin(), cfg.end(), p->cfg);
  p->channels = channels;
  for (py::handle f : fields) {
    py::tuple pair = py::reinterpret_borrow<py::tuple>(f);
    py::str name = pair[0];
    p->fields.emplace_back(py::reinterpret_steal<py::object>(PyUnicode_InternFromString(std::string(name).c_str())),
                           pair[1]);
  }
  p->local_rows = local_rows;
  p->remote_rows = remote_rows;
  Launch& l = *p->launch;
  p->x_slot = l.slot("x", 'Q');
  p->out_slot = l.slot(combine ? "combined_x" : "recv_x", 'Q');
  if (p->has_second) {
    p->second_slot = l.slot(combine ? "topk_weights" : "x_scales", 'Q');
    p->out2_slot = l.slot(combine ? "combined_topk_weights" : "recv_x_scales", 'Q');
  }
  return p;
}

void setup(py::dict s) {
  auto keep = [](py::handle o) {
    Py_INCREF(o.ptr());
    return o.ptr();
  };
  G.loader = keep(s["loader"]);
  G.launch_error = keep(s["launch_error"]);
  G.overlap = keep(s["overlap"]);
  G.handle = keep(s["handle"]);
  G.config = keep(s["config"]);
  G.event_base = keep(s["event_base"]);
  G.raw_stream = keep(s["raw_stream"]);
  G.capturing = keep(s["capturing"]);
  py::dict hc = s["host_counts"];
  G.hc_bad_me = hc["bad_me"].cast<int>();
  G.hc_bad_rank = hc["bad_rank"].cast<int>();
  G.hc_sent = hc["sent"].cast<int>();
  G.hc_recv = hc["recv"].cast<int>();
  G.hc_sig_rank = hc["sig_rank"].cast<int>();
  G.hc_expert = hc["expert"].cast<int>();
  G.ready = true;
}

// Entry points: torch's errors become the Python exceptions torch raises (AcceleratorError with its code).
#define CALLPATH_ENTRY(...) \
  HANDLE_TH_ERRORS          \
  __VA_ARGS__               \
  END_HANDLE_TH_ERRORS_PYBIND

}  // namespace

PYBIND11_MODULE(_commlib_callpath, m) {
  m.doc() = "commlib's C++ call path for the NVLink engine (csrc/callpath.cpp)";
  intern_names();
  m.def("_setup", &setup);
  m.def("_record", [](bool on, int launch_rc) {
    if (on && !recorder) recorder = new py::list();
    if (!on && recorder) {
      delete recorder;
      recorder = nullptr;
    }
    recorder_launch_rc = launch_rc;
  }, py::arg("on"), py::arg("launch_rc") = 0, "tests: record device operations instead of issuing them");
  m.def("_phases", [](bool on) {
    py::dict out;
    for (auto& p : phase_times) {
      py::str key(std::string(p.op) + "." + p.name);
      py::list ns = out.contains(key) ? py::list(out[key]) : py::list();
      for (u64 v : p.ns) ns.append(v);
      out[key] = ns;
    }
    phase_times.clear();
    phases_on = on;
    return out;
  }, py::arg("on"), "per-phase host timing on or off; returns {op.phase: [ns per mark]} since the last call");
  m.def("_recorded", []() {
    py::list out = recorder ? *recorder : py::list();
    if (recorder) *recorder = py::list();
    return out;
  });
  py::class_<Launch, LaunchP>(m, "Launch", py::module_local())
      .def(py::init<u64, unsigned, unsigned, unsigned, std::string, std::vector<std::string>, std::vector<size_t>,
                    py::bytes, py::object, bool>(),
           py::arg("fn"), py::arg("grid"), py::arg("block"), py::arg("shared_mem"), py::arg("codes"),
           py::arg("names"), py::arg("offsets"), py::arg("packed"), py::arg("variant"), py::arg("plain"))
      .def("packed", [](const Launch& l) { return py::bytes(l.bytes()); })
      .def("slot", &Launch::slot)
      .def("current", &Launch::current);
  py::class_<CachedPlan, std::shared_ptr<CachedPlan>>(m, "CachedPlan", py::module_local())
      .def(py::init(&make_cached_plan), py::arg("owner"), py::arg("launch"), py::arg("kind"), py::arg("dtype"),
           py::arg("shape"), py::arg("second_shape"), py::arg("out_shape"), py::arg("out_dtype"),
           py::arg("out2_shape"), py::arg("config_key"), py::arg("channels"), py::arg("fields"),
           py::arg("local_rows"), py::arg("remote_rows"));
  py::class_<PlanSet, std::shared_ptr<PlanSet>>(m, "PlanSet", py::module_local())
      .def(py::init<>())
      .def("add", &PlanSet::add)
      .def("__len__", [](const PlanSet& s) { return s.plans.size(); });
  py::class_<LayoutPlan, std::shared_ptr<LayoutPlan>>(m, "LayoutPlan", py::module_local()).def(py::init<LaunchP>());
  py::class_<FullTwin, std::shared_ptr<FullTwin>>(m, "FullTwin", py::module_local())
      .def(py::init<LaunchP, LaunchP, py::object, i64, i64, i64>(), py::arg("notify"), py::arg("dispatch"),
           py::arg("sig"), py::arg("L"), py::arg("C"), py::arg("E"));
  py::class_<Engine>(m, "Engine", py::module_local())
      .def(py::init<py::dict>())
      .def_property_readonly("served", &Engine::served)
      .def_readwrite("test_stream", &Engine::test_stream)
      .def("kept_dispatches", [](const Engine& e) { return e.full.size(); })
      .def("layout", [](Engine& e, py::handle buffer, py::handle topk, py::handle experts) {
        CALLPATH_ENTRY(return e.layout(buffer, topk, experts);)
      })
      .def("cached_dispatch", [](Engine& e, py::handle buffer, py::handle x, py::handle handle, py::handle alignment,
                                 py::handle config, py::handle prev, bool async_finish, bool alloc_on_comm) {
        CALLPATH_ENTRY(
            return e.cached_dispatch(buffer, x, handle, alignment, config, prev, async_finish, alloc_on_comm);)
      })
      .def("combine", [](Engine& e, py::handle buffer, py::handle x, py::handle handle, py::handle weights,
                         py::handle config, py::handle prev, bool async_finish, bool alloc_on_comm) {
        CALLPATH_ENTRY(return e.combine(buffer, x, handle, weights, config, prev, async_finish, alloc_on_comm);)
      })
      .def("dispatch", [](Engine& e, py::handle buffer, py::handle x, py::handle ntpr, py::handle nrr, py::handle tir,
                          py::handle ntpe, py::handle topk, py::handle w, py::handle alignment, py::handle worst,
                          py::handle config, py::handle prev, bool async_finish, bool alloc_on_comm) {
        CALLPATH_ENTRY(
            Engine::DispatchArgs a{x, py::none(), py::none(), ntpr, nrr, tir, ntpe, topk, w, alignment, worst,
                                   config, false};
            return e.dispatch(buffer, a, prev, async_finish, alloc_on_comm);)
      })
      .def("keep_dispatch", [](Engine& e, py::handle x, py::handle ntpr, py::handle nrr, py::handle tir,
                               py::handle ntpe, py::handle topk, py::handle w, py::handle alignment, py::handle worst,
                               py::handle config, std::shared_ptr<FullTwin> twin, py::handle handle) {
        CALLPATH_ENTRY(
            Engine::DispatchArgs a{x, py::none(), py::none(), ntpr, nrr, tir, ntpe, topk, w, alignment, worst,
                                   config, false};
            return e.keep_full(a, std::move(twin), handle);)
      });
}
