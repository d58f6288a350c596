// The internode engine's replayed cached dispatch and combine as whole C++ calls (built and loaded by
// commlib/cuda/callpath.py, beside csrc/callpath.cpp: the same Core, a module of its own).
//
// A call that the Python path would replay (commlib/buffer.py _replay / _enter / _leave,
// backends/internode/engine.py plan_for / run_plan, backends/internode/kept.py replay / run) runs here
// with no Python frame in between: the checks that let the call replay, the comm stream's wait, the
// outputs and the scratch, the kept launches patched with this call's addresses, one NCCL all-to-all
// per network chunk through torch's c10d ProcessGroup (the same op torch.distributed issues, on the
// comm stream, the stream waiting for it, never the host), the node step per chunk, the exit event.
// Where anything differs it returns None and the Python path runs the call, with every check.
//
// A handle's twin (``InPlan``) is made on its second call (the first made the Python kept call):
// the engine asks the backend's ``cpp_twin`` hook, which checks the call as plan_for does and
// describes the kept call as launch steps whose per-call slots name their source (module docstring
// of commlib/cuda/callpath.py). Tests (tests/test_callpath_internode.py) run it with the recorder.

#include "callpath.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace {

// One all-to-all with splits through the group's own op (what torch.distributed's all_to_all_single
// issues; alltoall_base is the name every torch this builds against has).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
c10::intrusive_ptr<c10d::Work> alltoall(c10d::ProcessGroup& pg, at::Tensor& out, at::Tensor& in,
                                        std::vector<int64_t>& out_splits, std::vector<int64_t>& in_splits) {
  c10d::AllToAllOptions opts;
  return pg.alltoall_base(out, in, out_splits, in_splits, opts);
}
#pragma GCC diagnostic pop

#define INTERNODE_NAMES(X) X(probe) X(recording) X(node) X(calls) X(area_address) X(cpp_internode) X(data_ptr)

struct InNames {
#define INTERNODE_DECLARE(n) PyObject* n = nullptr;
  INTERNODE_NAMES(INTERNODE_DECLARE)
#undef INTERNODE_DECLARE
};
InNames* NI = nullptr;

void intern_internode_names() {
  NI = new InNames();
#define INTERNODE_INTERN(n)               \
  NI->n = PyUnicode_InternFromString(#n); \
  if (!NI->n) throw py::error_already_set();
  INTERNODE_NAMES(INTERNODE_INTERN)
#undef INTERNODE_INTERN
}

// Where a per-call slot's value comes from (callpath.py IN_SOURCES, in this order), plus a byte offset.
enum Source { kX = 0, kSecond, kOut0, kOut1, kScratch, kArea, kNumSources };

struct Step {
  LaunchP launch;
  std::vector<std::array<i64, 3>> slots;  // (parameter position, Source, byte offset)
};

struct Chunk {
  i64 send_row, send_rows, out_row, out_rows;   // the chunk's rows in the scratch: what it sends, where rows land
  std::vector<i64> out_splits, in_splits;       // rows from / to each rail peer
  std::vector<Step> node;                       // its node step (forward after it landed, or reduce before it)
};

// A kept cached dispatch (kind 0, key: x's ScalarType) or combine (kind 1, key: the weights' columns)
// of one handle: what a call must match, its outputs and scratch, its launches and chunks.
struct InPlan {
  PyObject* owner = nullptr;  // the backend that made it (identity only)
  int kind = 0;
  i64 key = 0;
  py::object kept;            // the Python kept call: holds the tensors whose addresses the launches carry
  at::ScalarType dtype;
  Shape shape, second_shape;
  bool has_second = false;
  py::object config;          // the Config it was made with; an equal one fits too
  i64 cfg[5];
  py::object send_head;       // dispatch: the handle's send_head it was made for (identity)
  i64 T = 0;                  // combine: the handle's num_tokens
  Outputs out;                // the outputs (FP8 scales, combined weights: in the first's allocation)
  i64 rows = 0, width = 0;    // the scratch, uint8 [rows, width]
  std::vector<Step> pre, post;
  std::vector<Chunk> chunks;
  bool node_after = false;    // the node step follows each landed chunk (and every chunk is waited for)
  bool ordered = true;        // the network completes chunks in order: waiting for the last covers all
  bool uses_area = false;
  c10::intrusive_ptr<c10d::ProcessGroup> group;  // the rail group (null in tests: recorded only)
  std::vector<std::pair<py::object, i64>> row_counts;  // (counter, rows) added per call (Wiring.count_rows)

  bool launches_current() const {
    for (const auto* steps : {&pre, &post})
      for (const Step& s : *steps)
        if (!s.launch->current()) return false;
    for (const Chunk& c : chunks)
      for (const Step& s : c.node)
        if (!s.launch->current()) return false;
    return true;
  }
};

using InPlanP = std::shared_ptr<InPlan>;

using InPlanSet = PlanSetOf<InPlan>;

using ::FullKey;
constexpr auto config_fields = &FullKey::config_fields;

Step make_step(py::handle spec) {
  // (Launch, [(position, value)] set now, [(position, source, offset)] set per call, grid or None)
  py::tuple t = py::reinterpret_borrow<py::tuple>(spec);
  Step s;
  s.launch = std::make_shared<Launch>(*t[0].cast<LaunchP>());  // this plan's own copy
  for (py::handle fixed : t[1]) {
    py::tuple f = py::reinterpret_borrow<py::tuple>(fixed);
    s.launch->set_value(f[0].cast<int>(), f[1].cast<i64>());
  }
  for (py::handle per : t[2]) {
    py::tuple f = py::reinterpret_borrow<py::tuple>(per);
    i64 pos = f[0].cast<i64>(), src = f[1].cast<i64>();
    if (pos < 0 || pos >= static_cast<i64>(s.launch->codes.size()) || s.launch->codes[pos] != 'Q' || src < 0 ||
        src >= kNumSources)
      throw std::invalid_argument("InPlan: a per-call slot must be a pointer parameter with a known source");
    s.slots.push_back({pos, src, f[2].cast<i64>()});
  }
  if (!t[3].is_none()) s.launch->grid = t[3].cast<unsigned>();
  return s;
}

std::vector<Step> make_steps(py::handle specs) {
  std::vector<Step> out;
  for (py::handle s : specs) out.push_back(make_step(s));
  return out;
}

InPlanP make_in_plan(py::dict d) {
  auto p = std::make_shared<InPlan>();
  p->owner = d["owner"].ptr();
  p->kind = d["kind"].cast<int>();
  p->kept = d["kept"];
  p->dtype = d["dtype"].cast<at::ScalarType>();
  p->key = p->kind == 0 ? static_cast<i64>(p->dtype) : d["key"].cast<i64>();
  p->shape = d["shape"].cast<Shape>();
  p->has_second = !d["second_shape"].is_none();
  if (p->has_second) p->second_shape = d["second_shape"].cast<Shape>();
  p->config = d["config"];
  if (!config_fields(p->config, p->cfg)) throw std::invalid_argument("InPlan: the Config's fields must be ints");
  p->send_head = d["send_head"];
  p->T = d["num_tokens"].cast<i64>();
  p->out = Outputs(d["out_shape"].cast<Shape>(), d["out_dtype"].cast<at::ScalarType>(), d["out2_shape"], at::kFloat);
  p->rows = d["rows"].cast<i64>();
  p->width = d["width"].cast<i64>();
  p->pre = make_steps(d["pre"]);
  p->post = make_steps(d["post"]);
  for (py::handle c : d["chunks"]) {
    py::tuple t = py::reinterpret_borrow<py::tuple>(c);
    Chunk k{t[0].cast<i64>(), t[1].cast<i64>(), t[2].cast<i64>(), t[3].cast<i64>(), t[4].cast<std::vector<i64>>(),
            t[5].cast<std::vector<i64>>(), make_steps(t[6])};
    if (k.send_row + k.send_rows > p->rows || k.out_row + k.out_rows > p->rows)
      throw std::invalid_argument("InPlan: a chunk's rows are outside the scratch");
    p->chunks.push_back(std::move(k));
  }
  p->node_after = d["node_after"].cast<bool>();
  p->ordered = d["ordered"].cast<bool>();
  if (!d["group"].is_none()) p->group = d["group"].cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
  for (py::handle rc : d["row_counts"]) {
    py::tuple t = py::reinterpret_borrow<py::tuple>(rc);
    p->row_counts.emplace_back(py::reinterpret_borrow<py::object>(t[0]), t[1].cast<i64>());
  }
  auto area = [&](const std::vector<Step>& steps) {
    for (const Step& s : steps)
      for (auto& sl : s.slots) p->uses_area |= sl[1] == kArea;
  };
  area(p->pre);
  area(p->post);
  for (const Chunk& k : p->chunks) area(k.node);
  return p;
}

// A non-cached dispatch's kept launches on the device path (device.py Fresh, at one network chunk and
// one rank per node): meta, digest, pack, land (null where the first call landed no rows), recv_chan.
// Made by device.full_twin after a Python dispatch, only with COMMLIB_CALLPATH_INTERNODE_DISPATCH=1.
struct InFull {
  PyObject* owner = nullptr;  // the backend that made it (identity only)
  py::object fresh;           // device.py Fresh: holds the scratch whose addresses the launches carry
  LaunchP meta, digest, pack, land, recv_chan;
  std::vector<i64> sig;       // the signature words of the call it was made from (word 1: the call count)
  i64 E = 0;

  bool launches_current() const {
    for (const LaunchP& l : {meta, digest, pack, recv_chan})
      if (!l->current()) return false;
    return !land || land->current();
  }
};

using InFullP = std::shared_ptr<InFull>;

InFullP make_in_full(py::dict d) {
  auto f = std::make_shared<InFull>();
  f->owner = d["owner"].ptr();
  f->fresh = d["fresh"];
  f->meta = d["meta"].cast<LaunchP>();
  f->digest = d["digest"].cast<LaunchP>();
  f->pack = d["pack"].cast<LaunchP>();
  if (!d["land"].is_none()) f->land = d["land"].cast<LaunchP>();
  f->recv_chan = d["recv_chan"].cast<LaunchP>();
  f->sig = d["sig"].cast<std::vector<i64>>();
  f->E = d["num_experts"].cast<i64>();
  if (f->sig.size() < 2) throw std::invalid_argument("InFull: the signature has no call word");
  return f;
}

// A non-cached dispatch the Python path ran (its arguments' signature) and its kept launches.
struct InFullEntry : FullKey {
  InFullP twin;
};

// ------------------------------------------------------------------------------------------------
// InEngine: one Buffer's replays of internode cached dispatches and combines
// ------------------------------------------------------------------------------------------------

struct InEngine : Core {
  py::object make_twin;   // backend.cpp_twin(handle, kind, x, config, second): the handle's twin, or None
  i64 nccl_ns = 0;        // host time inside the NCCL calls (issue and the stream's wait), for the benchmarks
  std::vector<std::shared_ptr<InFullEntry>> full;   // kept non-cached dispatches (opt-in, see InFull)
  i64 full_found = 0;     // non-cached dispatches that matched a kept one (tests: the replay is not built yet)

  explicit InEngine(py::dict s) : Core(s, {kCached, kCombine}), make_twin(s["make_twin"]) {}

  // The backend of ``buffer`` if it may serve a call: Buffer alive, backend not failed, its node step
  // open, no recording probe (a probe wants the Python path's step marks and counts).
  py::object live_backend(py::handle buffer) override {
    if (truthy(attr(buffer, N->_destroyed))) return py::object();
    py::object backend = attr(buffer, N->backend);
    if (truthy(attr(backend, N->failed)) || attr(backend, NI->node).is_none()) return py::object();
    if (truthy(attr(attr(backend, NI->probe), NI->recording))) return py::object();
    return backend;
  }

  // The kept call's twin for this call (engine.py plan_for), made through the hook where the handle
  // has none that fits yet; null where the call takes the Python path.
  InPlan* plan_for(py::handle backend, py::handle handle, int kind, i64 key, const at::Tensor& x, py::handle xo,
                   py::handle second, py::handle cfg, i64 T) {
    py::object extra = attr(handle, N->extra);
    if (!PyDict_Check(extra.ptr())) return nullptr;
    PyObject* set = PyDict_GetItem(extra.ptr(), NI->cpp_internode);
    InPlan* p = set ? py::cast<InPlanSet*>(py::handle(set))->find(kind, key) : nullptr;
    if (p && fits(*p, backend, handle, x, second, cfg, T)) return p;
    ++py_ops.call;
    py::object made = make_twin(handle, kind, xo, cfg, second);   // the Python kept call's checks (plan_for)
    if (made.is_none()) return nullptr;
    p = made.cast<InPlan*>();
    return p->kind == kind && p->key == key && fits(*p, backend, handle, x, second, cfg, T) ? p : nullptr;
  }

  // kept.py _Kept.fits and its subclasses', and what the launches read of the inputs.
  // ``T``: a combine's handle.num_tokens (combine_args read it).
  bool fits(const InPlan& p, py::handle backend, py::handle handle, const at::Tensor& x, py::handle second,
            py::handle cfg, i64 T) const {
    if (p.owner != backend.ptr() || (!test && !p.group)) return false;
    if (x.scalar_type() != p.dtype || !same_shape(x, p.shape) || x.get_device() != dev || !x.is_contiguous())
      return false;
    if (cfg.ptr() != p.config.ptr()) {
      i64 v[5];
      if (Py_TYPE(cfg.ptr()) != Py_TYPE(p.config.ptr()) || !config_fields(cfg, v) || !std::equal(v, v + 5, p.cfg))
        return false;
    }
    if (p.kind == 0) {
      if (attr(handle, N->send_head).ptr() != p.send_head.ptr()) return false;
    } else if (T != p.T) {
      return false;
    }
    if (!p.launches_current()) return false;
    if (!p.has_second) return second.is_none();
    if (!is_tensor(second)) return false;
    const at::Tensor& s = tensor(second);
    return s.scalar_type() == at::kFloat && same_shape(s, p.second_shape) && s.get_device() == dev &&
           s.is_contiguous();
  }

  // ``steps``' launches on the comm stream with this call's addresses; their time is phase ``phase``.
  void issue(const std::vector<Step>& steps, const u64* src, Phases& ph, const char* phase) {
    if (steps.empty()) return;
    for (const Step& s : steps) {
      Launch& l = *s.launch;
      for (auto& sl : s.slots) l.set(static_cast<int>(sl[0]), src[sl[1]] + static_cast<u64>(sl[2]));
      l.issue(comm.raw);
    }
    ph.mark(phase);
  }

  // One network chunk: the rail all-to-all of its rows (NCCL on the current stream, the comm stream).
  c10::intrusive_ptr<c10d::Work> post(InPlan& p, Chunk& c, at::Tensor& scratch) {
    // the chunk's rows as tensors carved without the dispatcher (what scratch.narrow(0, row, rows) views)
    at::Tensor send = carve(scratch, c.send_row * p.width, {c.send_rows, p.width}, at::kByte),
               out = carve(scratch, c.out_row * p.width, {c.out_rows, p.width}, at::kByte);
    if (test)
      record(py::make_tuple("a2a", address(out), address(send), py::tuple(py::cast(c.out_splits)),
                            py::tuple(py::cast(c.in_splits))));
    if (!p.group) return {};
    auto t0 = Clock::now();
    auto work = alltoall(*p.group, out, send, c.out_splits, c.in_splits);
    nccl_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
    return work;
  }

  // The current (comm) stream waits for a posted chunk (NCCL: no host wait).
  void land(const c10::intrusive_ptr<c10d::Work>& work) {
    if (test) record(py::make_tuple("a2a_wait"));
    if (!work) return;
    auto t0 = Clock::now();
    work->wait();
    nccl_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
  }

  // kept.py replay + run and Buffer._leave. Returns (first output, second output or None, EventOverlap).
  py::tuple run(py::handle backend, InPlan& p, py::handle xo, py::handle second, py::handle prev, bool async_finish,
                bool alloc_on_comm, Phases& ph) {
    Stream compute = current();
    bool on_compute = enter(compute, prev, alloc_on_comm);
    ph.mark("enter");
    std::vector<at::Tensor> blocks;
    at::Tensor out1, out2;
    {
      AllocOn guard(*this, comm, !on_compute);
      std::tie(out1, out2) = outputs(p.out, blocks);
    }
    ph.mark("alloc");
    set_attr(backend, NI->calls, int_obj(as_int(attr(backend, NI->calls)) + 1));
    set_attr(backend, N->replayed, int_obj(as_int(attr(backend, N->replayed)) + 1));
    ph.mark("count");
    {
      AllocOn on_comm(*this, comm, true);   // the comm stream current: the scratch's and NCCL's stream
      at::Tensor scratch = empty({p.rows, p.width}, at::kByte);
      ph.mark("scratch");
      u64 src[kNumSources] = {address(tensor(xo)), second.is_none() ? 0 : address(tensor(second)), address(out1),
                              p.out.two ? address(out2) : 0, address(scratch), 0};
      if (test) record(py::make_tuple("scratch", src[kScratch], p.rows * p.width));
      if (p.uses_area) {
        ++py_ops.call;
        py::object a = attr(attr(backend, NI->node), NI->area_address)();
        src[kArea] = static_cast<u64>(as_int(a));
        ph.mark("area");
      }
      issue(p.pre, src, ph, "pre");
      const size_t n = p.chunks.size();
      c10::intrusive_ptr<c10d::Work> posted;
      for (size_t k = 0; k < n; ++k) {   // network.py stream(): chunk k + 1 on the wire before chunk k lands
        if (!p.node_after) issue(p.chunks[k].node, src, ph, "node");
        auto work = post(p, p.chunks[k], scratch);
        ph.mark("a2a");
        if (k && (p.node_after || !p.ordered)) {
          land(posted);
          ph.mark("wait");
          if (p.node_after) issue(p.chunks[k - 1].node, src, ph, "node");
        }
        posted = std::move(work);
      }
      if (n) {
        land(posted);
        ph.mark("wait");
        if (p.node_after) issue(p.chunks[n - 1].node, src, ph, "node");
      }
      issue(p.post, src, ph, "post");
    }
    py::object counters = attr(backend, N->counters);
    for (auto& [key, add] : p.row_counts) add_count(counters, key.ptr(), add);
    ++served_n[p.kind ? kCombine : kCached];
    ph.mark("count");
    std::vector<py::handle> inputs{xo};
    if (!second.is_none()) inputs.push_back(second);
    py::object overlap = leave(compute, blocks, inputs, async_finish, on_compute);
    ph.mark("leave");
    return py::make_tuple(wrap(std::move(out1)), p.out.two ? wrap(std::move(out2)) : py::none(), overlap);
  }

  // Buffer.dispatch keeps a non-cached dispatch it ran on the device path (``twin``: its launches,
  // ``handle``: the handle it returned), so the next call like it can run here. False where the call
  // is not one the C++ path takes.
  bool keep_dispatch(DispatchArgs a, InFullP twin, py::handle handle) {
    auto e = std::make_shared<InFullEntry>();
    if (!twin || !e->capture(a, buffer_type)) return false;
    const at::Tensor& d = tensor(a.data);
    if (d.dim() != 2 || e->ntpe.shape.size() != 1 || e->ntpe.shape[0] != twin->E || e->tir.shape.size() != 2 ||
        e->tir.shape[1] != R || e->tir.shape[0] != d.size(0))
      return false;
    e->twin = std::move(twin);
    keep_entry(full, std::move(e), handle);
    return true;
  }

  // Buffer.dispatch(x, num_tokens_per_rank=..., topk_idx=..., ...) like a kept one: the checks that let
  // it run here. The steps themselves (meta, the count all-gather, digest and its host read, geometry,
  // pack, the rail all-to-all, land, recv_chan, the handle) are not built yet: None, the Python path.
  py::object dispatch(py::handle buffer, DispatchArgs a, py::handle prev, bool async_finish, bool alloc_on_comm) {
    if (full.empty() || !split_dispatch(a)) return py::none();
    std::shared_ptr<InFullEntry> found;
    for (auto& e : full)
      if (e->fits(a, buffer_type)) {
        found = e;
        break;
      }
    if (!found) return py::none();
    const at::Tensor& x = tensor(a.data);
    if (!x.is_contiguous() || x.get_device() != dev) return py::none();
    py::object backend = live_backend(buffer);
    if (!backend || backend.ptr() != found->twin->owner || !found->twin->launches_current()) return py::none();
    if (!stream_args_ok(prev, async_finish, alloc_on_comm)) return py::none();
    ++full_found;
    return py::none();
  }

  // Buffer.dispatch(x, handle=handle, ...) replayed: the 6-tuple it returns, or None.
  py::object cached_dispatch(py::handle buffer, py::handle x, py::handle handle, py::handle alignment,
                             py::handle config, py::handle prev, bool async_finish, bool alloc_on_comm) {
    Phases ph("in_cached");
    CachedArgs a;
    if (!dispatch_args(buffer, x, handle, alignment, config, a)) return py::none();
    InPlan* p = plan_for(a.backend, handle, 0, a.key, *a.x, a.data, a.second, a.cfg, a.T);
    if (!p || !stream_args_ok(prev, async_finish, alloc_on_comm)) return py::none();
    ph.mark("checks");
    py::object result =
        dispatch_result(run(a.backend, *p, a.data, a.second, prev, async_finish, alloc_on_comm, ph), a, handle);
    ph.mark("result");
    return result;
  }

  // Buffer.combine(x, handle, topk_weights, ...) replayed (no bias, finish_later False): its 3-tuple, or None.
  py::object combine(py::handle buffer, py::handle x, py::handle handle, py::handle weights, py::handle config,
                     py::handle prev, bool async_finish, bool alloc_on_comm) {
    Phases ph("in_combine");
    CachedArgs a;
    if (!combine_args(buffer, x, handle, weights, config, a)) return py::none();
    InPlan* p = plan_for(a.backend, handle, 1, a.key, *a.x, x, weights, a.cfg, a.T);
    if (!p || !stream_args_ok(prev, async_finish, alloc_on_comm)) return py::none();
    ph.mark("checks");
    py::tuple out = run(a.backend, *p, x, weights, prev, async_finish, alloc_on_comm, ph);
    ph.mark("result");
    return out;
  }
};

}  // namespace

PYBIND11_MODULE(_commlib_callpath_internode, m) {
  m.doc() = "commlib's C++ call path for the internode engine (csrc/callpath_internode.cpp)";
  intern_names();
  intern_internode_names();
  m.def("_setup", &setup_globals);
  def_common(m);
  m.def("_alltoall", [](py::object group, at::Tensor out, at::Tensor in, std::vector<i64> out_splits,
                        std::vector<i64> in_splits) {
    // tests: one chunk's collective as the engine issues it (c10d from C++), waited for
    auto pg = group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
    alltoall(*pg, out, in, out_splits, in_splits)->wait();
  });
  py::class_<InPlan, InPlanP>(m, "InPlan", py::module_local())
      .def(py::init(&make_in_plan))
      .def_readonly("kind", &InPlan::kind)
      .def_readonly("key", &InPlan::key);
  py::class_<InFull, InFullP>(m, "InFull", py::module_local())
      .def(py::init(&make_in_full))
      .def("launches", [](const InFull& f) {   // tests: each kept launch's kernel handle and packed arguments
        py::list out;
        for (const LaunchP& l : {f.meta, f.digest, f.pack, f.land, f.recv_chan})
          out.append(l ? py::object(py::make_tuple(l->fn, l->grid, l->block, l->smem,
                                                   py::bytes(reinterpret_cast<const char*>(l->store.data()), l->nbytes)))
                       : py::none());
        return out;
      });
  py::class_<InPlanSet, std::shared_ptr<InPlanSet>>(m, "InPlanSet", py::module_local())
      .def(py::init<>())
      .def("add", &InPlanSet::add)
      .def("__len__", [](const InPlanSet& s) { return s.plans.size(); });
  py::class_<InEngine>(m, "Engine", py::module_local())
      .def(py::init<py::dict>())
      .def_property_readonly("served", &InEngine::served)
      .def_readonly("nccl_ns", &InEngine::nccl_ns)
      .def_readwrite("test_stream", &InEngine::test_stream)
      .def("layout", [](InEngine&, py::handle, py::handle, py::handle) { return py::none(); })
      .def_readonly("full_found", &InEngine::full_found)
      .def("dispatch", [](InEngine& e, py::handle buffer, py::handle x, py::handle ntpr, py::handle nrr, py::handle tir,
                          py::handle ntpe, py::handle topk, py::handle w, py::handle alignment, py::handle worst,
                          py::handle config, py::handle prev, bool async_finish, bool alloc_on_comm) {
        CALLPATH_ENTRY(
            DispatchArgs a{x, py::none(), py::none(), ntpr, nrr, tir, ntpe, topk, w, alignment, worst, config, false};
            return e.dispatch(buffer, a, prev, async_finish, alloc_on_comm);)
      })
      .def("keep_dispatch", [](InEngine& e, py::handle x, py::handle ntpr, py::handle nrr, py::handle tir,
                               py::handle ntpe, py::handle topk, py::handle w, py::handle alignment, py::handle worst,
                               py::handle config, InFullP twin, py::handle handle) {
        CALLPATH_ENTRY(
            DispatchArgs a{x, py::none(), py::none(), ntpr, nrr, tir, ntpe, topk, w, alignment, worst, config, false};
            return py::bool_(e.keep_dispatch(a, std::move(twin), handle));)
      })
      .def("cached_dispatch", [](InEngine& e, py::handle buffer, py::handle x, py::handle handle, py::handle alignment,
                                 py::handle config, py::handle prev, bool async_finish, bool alloc_on_comm) {
        CALLPATH_ENTRY(
            return e.cached_dispatch(buffer, x, handle, alignment, config, prev, async_finish, alloc_on_comm);)
      })
      .def("combine", [](InEngine& e, py::handle buffer, py::handle x, py::handle handle, py::handle weights,
                         py::handle config, py::handle prev, bool async_finish, bool alloc_on_comm) {
        CALLPATH_ENTRY(return e.combine(buffer, x, handle, weights, config, prev, async_finish, alloc_on_comm);)
      });
}
