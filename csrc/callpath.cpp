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

#include "callpath.h"

namespace {

// A cached dispatch's or a combine's kept launch (engine.py CachedPlan), kept on its handle.
struct CachedPlan {
  PyObject* owner;  // the backend that made it (identity only, never dereferenced)
  LaunchP launch;
  int kind;         // 0 cached dispatch, 1 combine
  i64 key;          // dispatch: x's dtype; combine: the weights' columns
  at::ScalarType dtype;
  Shape shape, second_shape;
  bool has_second;
  Outputs out;      // the outputs, the second (with a second input) in the first's allocation
  i64 cfg[3];       // num_sms, num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens
  i64 channels;
  std::vector<std::pair<py::object, py::object>> fields;  // (handle attribute, the tensor the launch points at)
  i64 local_rows, remote_rows;
  int x_slot, second_slot = -1, out_slot, out2_slot = -1;
};

using PlanSet = PlanSetOf<CachedPlan>;

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

// A non-cached dispatch the Python path ran: its arguments' signature and the launches it kept.
struct FullEntry : FullKey {
  std::shared_ptr<FullTwin> twin;
  i64 T, H, S, Kk;
};

// ------------------------------------------------------------------------------------------------
// Engine: one Buffer's comm stream, events and kept non-cached dispatches
// ------------------------------------------------------------------------------------------------

struct Engine : Core {
  std::vector<std::shared_ptr<FullEntry>> full;

  explicit Engine(py::dict s) : Core(s, {kLayout, kCached, kCombine, kDispatch}) {}

  // ---------------------------------------------------------------- shared checks and bookkeeping
  // The backend of ``buffer`` if it may serve a call: Buffer alive, backend not failed or destroyed.
  py::object live_backend(py::handle buffer) override {
    if (truthy(attr(buffer, N->_destroyed))) return py::object();
    py::object backend = attr(buffer, N->backend);
    if (truthy(attr(backend, N->failed)) || attr(backend, N->_base).is_none()) return py::object();
    return backend;
  }

  bool ring_is(py::handle backend, i64 channels) {
    i64 c;
    return exact_int(attr(backend, N->_ring_channels), &c) && c == channels;
  }

  // The backend's counts of a replayed call (replayed, counters; a zero count left as it is).
  void count_call(py::handle backend, Op op, i64 local, i64 remote) {
    set_attr(backend, N->replayed, int_obj(as_int(attr(backend, N->replayed)) + 1));
    ++served_n[op];
    if (!local && !remote) return;
    py::object counters = attr(backend, N->counters);
    for (auto [key, add] : {std::pair<PyObject*, i64>{N->local_rows, local}, {N->intranode_rows, remote}})
      if (add) add_count(counters, key, add);
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
      std::tie(out1, out2) = outputs(p.out, blocks);
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
    CachedArgs a;
    if (!dispatch_args(buffer, x, handle, alignment, config, a)) return py::none();
    CachedPlan* p = plan_for(a.backend, handle, 0, a.key, *a.x, a.cfg, a.second);
    if (!p || !stream_args_ok(prev, async_finish, alloc_on_comm)) return py::none();
    ph.mark("checks");
    py::object result =
        dispatch_result(run_cached(a.backend, *p, a.data, a.second, prev, async_finish, alloc_on_comm, ph), a, handle);
    ph.mark("result");
    return result;
  }

  // Buffer.combine(x, handle, topk_weights, ...) replayed (no bias, finish_later False): its 3-tuple, or None.
  py::object combine(py::handle buffer, py::handle x, py::handle handle, py::handle weights, py::handle config,
                     py::handle prev, bool async_finish, bool alloc_on_comm) {
    Phases ph("combine");
    CachedArgs a;
    if (!combine_args(buffer, x, handle, weights, config, a)) return py::none();
    CachedPlan* p = plan_for(a.backend, handle, 1, a.key, *a.x, a.cfg, weights);
    if (!p || !stream_args_ok(prev, async_finish, alloc_on_comm)) return py::none();
    ph.mark("checks");
    py::tuple out = run_cached(a.backend, *p, x, weights, prev, async_finish, alloc_on_comm, ph);
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
  std::shared_ptr<FullEntry> find_full(const DispatchArgs& a) {
    for (auto& e : full)
      if (e->fits(a, buffer_type)) return e;
    return nullptr;
  }

  // Buffer.dispatch keeps a non-cached dispatch it ran with these arguments and the backend's launches
  // (``twin``; ``handle``: the handle it returned), so the next call like it runs here. False where the
  // call is not one the C++ path takes.
  bool keep_full(DispatchArgs a, std::shared_ptr<FullTwin> twin, py::handle handle) {
    auto e = std::make_shared<FullEntry>();
    if (!e->capture(a, buffer_type)) return false;
    const at::Tensor& d = tensor(a.data);
    if (d.dim() != 2) return false;
    e->T = d.size(0);
    e->H = d.size(1);
    e->S = 0;
    if (a.x_tuple) {
      const at::Tensor& s = tensor(a.scales);
      // the float32 [T, H / 128] scales the transports move as they are (validate.scales_carrier)
      if (s.scalar_type() != at::kFloat || s.dim() != 2 || s.size(1) != e->H / 128 || !s.is_contiguous()) return false;
      e->S = s.size(1);
    }
    e->Kk = tensor(a.topk).size(1);
    if (e->ntpe.shape.size() != 1 || twin->E != e->ntpe.shape[0] || e->tir.shape.size() != 2 || e->tir.shape[1] != R)
      return false;
    e->twin = std::move(twin);
    keep_entry(full, std::move(e), handle);
    return true;
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
      ++py_ops.call;
      backend.attr(N->count_wait_failed)(seq, err, status == 1);
      throw std::runtime_error("count_wait_failed returned");  // it raises
    }
    std::vector<int32_t> host(words);
    for (size_t i = 0; i < words; ++i) host[i] = counts[i];
    return host;
  }

  // Buffer.dispatch(x, num_tokens_per_rank=..., topk_idx=..., ...) run here: its 6-tuple, or None.
  py::object dispatch(py::handle buffer, DispatchArgs a, py::handle prev, bool async_finish, bool alloc_on_comm) {
    Phases ph("dispatch");
    if (full.empty() || !split_dispatch(a)) return py::none();
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
    ph.mark("checks");

    const i64 T = e.T, H = e.H, L = tw.L, C = tw.C, worst = e.worst;
    const at::Tensor& tir = tensor(a.tir);
    const at::Tensor& topk = tensor(a.topk);
    Stream compute = current();
    bool on_compute = enter(compute, prev, alloc_on_comm);
    ph.mark("enter");
    std::vector<at::Tensor> blocks;
    at::Tensor cpm, rpm, rcp, counts;
    {
      AllocOn guard(*this, comm, !on_compute);
      cpm = blocks.emplace_back(empty({R, C}, at::kInt));
      rpm = blocks.emplace_back(empty({R, R}, at::kInt));
      rcp = blocks.emplace_back(empty({R, C}, at::kInt));
      if (worst) counts = blocks.emplace_back(empty({G.hc_expert + L}, at::kInt));
    }
    ph.mark("alloc");
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
    ph.mark("notify");
    std::vector<int32_t> host;
    i64 rows = worst;
    if (!worst) {
      host = wait_counts(backend, tw, seq, static_cast<size_t>(G.hc_expert + L));
      if (host[G.hc_bad_me] != 0 || host[G.hc_bad_rank] >= 0 || host[G.hc_sig_rank] >= 0)
        backend.attr(N->_raise_bad_ids)(py::cast(host), tw.sig);  // raises where the exchange found a fault
      rows = host[0];
      ph.mark("wait");   // the count poll: notify's flag (the device's earlier work, the peers)
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
    ph.mark("alloc_out");
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
    ph.mark("launch");

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
        per_expert.append(align_up(c, e.alignment));
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
    ph.mark("handle");
    py::object overlap = leave(compute, blocks, dispatch_inputs(a), async_finish, on_compute);
    ph.mark("leave");
    py::object recv = a.x_tuple ? py::object(py::make_tuple(wrap(recv_x), wrap(recv_scales))) : wrap(recv_x);
    py::object out = py::make_tuple(recv, wrap(recv_topk), a.w.is_none() ? py::none() : wrap(recv_w), per_expert, h,
                                    overlap);
    ph.mark("result");
    return out;
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
  if (p->has_second) p->second_shape = second_shape.cast<Shape>();
  p->key = combine ? (p->has_second ? p->second_shape.at(1) : 0) : static_cast<i64>(dtype);
  p->out = Outputs(std::move(out_shape), out_dtype, out2_shape, at::kFloat);
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
  setup_globals(s);
  py::dict hc = s["host_counts"];
  G.hc_bad_me = hc["bad_me"].cast<int>();
  G.hc_bad_rank = hc["bad_rank"].cast<int>();
  G.hc_sent = hc["sent"].cast<int>();
  G.hc_recv = hc["recv"].cast<int>();
  G.hc_sig_rank = hc["sig_rank"].cast<int>();
  G.hc_expert = hc["expert"].cast<int>();
}

}  // namespace

PYBIND11_MODULE(_commlib_callpath, m) {
  m.doc() = "commlib's C++ call path for the NVLink engine (csrc/callpath.cpp)";
  intern_names();
  m.def("_setup", &setup);
  def_common(m);
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
            DispatchArgs a{x, py::none(), py::none(), ntpr, nrr, tir, ntpe, topk, w, alignment, worst,
                                   config, false};
            return e.dispatch(buffer, a, prev, async_finish, alloc_on_comm);)
      })
      .def("keep_dispatch", [](Engine& e, py::handle x, py::handle ntpr, py::handle nrr, py::handle tir,
                               py::handle ntpe, py::handle topk, py::handle w, py::handle alignment, py::handle worst,
                               py::handle config, std::shared_ptr<FullTwin> twin, py::handle handle) {
        CALLPATH_ENTRY(
            DispatchArgs a{x, py::none(), py::none(), ntpr, nrr, tir, ntpe, topk, w, alignment, worst,
                                   config, false};
            return e.keep_full(a, std::move(twin), handle);)
      });
}
