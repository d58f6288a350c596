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

#include <numeric>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <ATen/ops/zeros.h>

#include <optional>

namespace {

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
// A collective's options asyncOp, where this torch's options have it (else the op stays async, and the
// caller waits for the work it returns, as utils/dist.py direct_collective does).
template <class Options>
auto set_async(Options& o, bool v, int) -> decltype(o.asyncOp = v, void()) {
  o.asyncOp = v;
}
template <class Options>
void set_async(Options&, bool, long) {}

// One all-to-all with splits through the group's own op (what torch.distributed's all_to_all_single
// issues; alltoall_base is the name every torch this builds against has). ``sync``: on the current
// stream, ordered there (no work to wait for, utils/dist.py direct_collective).
c10::intrusive_ptr<c10d::Work> alltoall(c10d::ProcessGroup& pg, at::Tensor& out, at::Tensor& in,
                                        std::vector<int64_t>& out_splits, std::vector<int64_t>& in_splits,
                                        bool sync = false) {
  c10d::AllToAllOptions opts;
  set_async(opts, !sync, 0);
  return pg.alltoall_base(out, in, out_splits, in_splits, opts);
}

// The count exchange's all-gather of ``in`` from every rank into ``out`` (the group's own op, what
// torch.distributed's all_gather_into_tensor issues) on the current stream.
c10::intrusive_ptr<c10d::Work> allgather(c10d::ProcessGroup& pg, at::Tensor& out, at::Tensor& in) {
  c10d::AllgatherOptions opts;
  set_async(opts, false, 0);
  return pg._allgather_base(out, in, opts);
}
#pragma GCC diagnostic pop

#define INTERNODE_NAMES(X)                                                                                    \
  X(probe) X(recording) X(node) X(calls) X(area_address) X(cpp_internode) X(data_ptr) X(num_chunks) X(num_recv) \
  X(node_rows) X(send_splits) X(recv_splits) X(send_starts) X(recv_starts) X(fan_send) X(fan_recv) X(home_lens) \
  X(slot) X(land_all) X(row_counts) X(plan) X(internode_rows) X(landed_pos) X(reserve) X(fan) X(settled)

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

// The side stream a dispatch's chunks alternate with (network.py RailStep.side: its torch stream, and
// its fork and join events, each recorded once so that its cudaEvent_t exists); unset: one stream.
struct SideStream {
  bool set = false;
  i64 id = 0;
  u64 raw = 0;
  void *fork_ev = nullptr, *join_ev = nullptr;
  py::object keep;            // the torch stream and events (alive while the twin is)

  void parse(py::handle o) {
    if (o.is_none()) return;
    py::dict t = py::reinterpret_borrow<py::dict>(o);
    set = true;
    id = t["stream_id"].cast<i64>();
    raw = t["raw"].cast<u64>();
    fork_ev = reinterpret_cast<void*>(t["fork"].cast<u64>());
    join_ev = reinterpret_cast<void*>(t["join"].cast<u64>());
    keep = t["keep"];
  }
};

// fanout.py chunk_sides and two_stream_syncs: chunk k of n on the side stream (the last on the comm
// stream, the ones before alternating), and the node barrier's pieces its forward takes after the pack's
// arrival (the first forward of each stream waits, the last takes the barrier after the stores).
constexpr i64 kSyncArriveEnd = 2, kSyncWaitEnd = 4, kSyncWaitStart = 8;
inline bool chunk_side(i64 k, i64 n) { return (n - 1 - k) % 2 == 1; }
inline i64 two_stream_sync(i64 k, i64 n) {
  return (k <= 1 ? kSyncWaitStart : 0) | (k == n - 1 ? kSyncArriveEnd | kSyncWaitEnd : 0);
}

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
  at::Tensor scratch;         // it, in the engine's staging rows (kept.py _Kept.scratch; undefined: one per call)
  std::vector<Step> pre, post;
  std::vector<Chunk> chunks;
  bool node_after = false;    // the node step follows each landed chunk (and every chunk is waited for)
  bool ordered = true;        // the network completes chunks in order: waiting for the last covers all
  bool sync = false;          // the chunks on the current stream, ordered there: no work, no wait (network.py)
  bool uses_area = false;
  SideStream side;            // a cached dispatch's chunks on two streams (network.py stream's ``sides``)
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
  if (!d["scratch"].is_none()) {
    p->scratch = d["scratch"].cast<at::Tensor>();
    if (p->scratch.scalar_type() != at::kByte || !p->scratch.is_contiguous() || p->scratch.numel() != p->rows * p->width)
      throw std::invalid_argument("InPlan: the scratch must be contiguous uint8 [rows, width]");
  }
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
  p->sync = d["sync"].cast<bool>();
  p->side.parse(d["two"]);
  if (p->side.set && !p->node_after) throw std::invalid_argument("InPlan: two streams need a node step after each chunk");
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

// The digest of the gathered exchange rows by name (backends/internode/exchange.py parse_digest, its order).
struct Digest {
  i64 error = 0, num_chunks = 0, num_recv = 0, node_rows = 0;
  std::vector<i64> mine, rail_in, experts;
  std::vector<std::vector<i64>> fan_send, fan_recv;  // [Kc][P]

  static i64 length(i64 M, i64 P, i64 Kc, i64 Lx) { return 4 + 2 * M + 2 * Kc * P + Lx; }

  Digest(const i64* d, i64 n, i64 M, i64 P, i64 Kc, i64 Lx) {
    if (n < length(M, P, Kc, Lx)) throw std::invalid_argument("Digest: shorter than its layout");
    error = d[0];
    num_chunks = d[1];
    num_recv = d[2];
    node_rows = d[3];
    const i64 i = 4 + 2 * M, j = i + Kc * P;
    mine.assign(d + 4, d + 4 + M);
    rail_in.assign(d + 4 + M, d + i);
    for (i64 k = 0; k < Kc; ++k) {
      fan_send.emplace_back(d + i + k * P, d + i + (k + 1) * P);
      fan_recv.emplace_back(d + j + k * P, d + j + (k + 1) * P);
    }
    experts.assign(d + j + Kc * P, d + j + Kc * P + Lx);
  }

  py::dict dict() const {
    py::dict o;
    o["error"] = error;
    o["num_chunks"] = num_chunks;
    o["num_recv"] = num_recv;
    o["node_rows"] = node_rows;
    o["mine"] = py::cast(mine);
    o["rail_in"] = py::cast(rail_in);
    o["fan_send"] = py::cast(fan_send);
    o["fan_recv"] = py::cast(fan_recv);
    o["experts"] = py::cast(experts);
    return o;
  }
};

// The kept launches' argument positions a non-cached dispatch sets (backends/internode/kernels.py).
struct FullSlots {
  int meta_tir, meta_topk, meta_experts, meta_head;
  int pack_tir, pack_slot, pack_send_head, pack_rank_prefix, pack_chan_prefix, pack_x, pack_scales, pack_topk, pack_w,
      pack_send;
  int land_rows, land_n, land_n_out, land_x, land_scales, land_src, land_topk, land_w, land_pos;
  int recv_chan_src, recv_chan_out;
  explicit FullSlots(py::dict d) {
    auto g = [&](const char* n) { return d[n].cast<int>(); };
    meta_tir = g("META_TIR"), meta_topk = g("META_TOPK"), meta_experts = g("META_EXPERTS"), meta_head = g("META_HEAD");
    pack_tir = g("PACK_TIR"), pack_slot = g("PACK_SLOT"), pack_send_head = g("PACK_SEND_HEAD");
    pack_rank_prefix = g("PACK_RANK_PREFIX"), pack_chan_prefix = g("PACK_CHAN_PREFIX"), pack_x = g("PACK_X");
    pack_scales = g("PACK_SCALES"), pack_topk = g("PACK_TOPK"), pack_w = g("PACK_W"), pack_send = g("PACK_SEND");
    land_rows = g("LAND_ROWS"), land_n = g("LAND_N"), land_n_out = g("LAND_N_OUT"), land_x = g("LAND_X");
    land_scales = g("LAND_SCALES"), land_src = g("LAND_SRC"), land_topk = g("LAND_TOPK"), land_w = g("LAND_W");
    land_pos = g("LAND_POS"), recv_chan_src = g("RECV_CHAN_SRC"), recv_chan_out = g("RECV_CHAN_OUT");
  }
};

// A non-cached dispatch's kept launches on the device path (device.py Fresh: meta, digest, pack, land,
// recv_chan; with the forwarder, P > 1, its barrier and forward too) and what serving a call like it
// needs: the scratch, the shapes, the hooks into Python (twins.py full_twin). Made by twins.full_twin
// after a Python dispatch, unless COMMLIB_CALLPATH_INTERNODE_DISPATCH=0.
struct InFull {
  PyObject* owner = nullptr;  // the backend that made it (identity only)
  py::object fresh;           // device.py Fresh: holds the scratch whose addresses the launches carry
  LaunchP meta, digest, pack, land, recv_chan;
  LaunchP barrier, forward;   // the forwarder's (P > 1): its node barrier, a landed chunk's forward
  i64 ring = 1, area_row = 0;            // rows per chunk slot (geometry.chunk_rows); the areas' widest row
  i64 fwd_threads = 512, fwd_ctas = 16;  // fanout.py grid: the forward's threads and most CTAs
  int fwd_landed = 0, fwd_j = 1, fwd_pos = 10, fwd_sync = 14;  // fanout.py FORWARD_LANDED, _J, _POS, _SYNC: per chunk
  SideStream side;            // the chunks on two streams, with the forwarder (network.py stream's ``sides``)
  std::vector<i64> sig;       // the signature words (word 1: the call count, set per call)
  i64 E = 0, M = 0, P = 0, Kc = 0, Lx = 0, T = 0, H = 0, C = 0, K = 0, W = 0, S = -1;
  bool weights = false, pinned = false;
  at::ScalarType dtype = at::kByte;
  i64 ends[5];                // byte offsets in the int32 block: chan, recv_chan prefixes, send_head, slot, src idx
  i64 threads = 512, max_ctas = 264;
  FullSlots slots;
  at::Tensor row, g, dig;     // the exchange row, the gathered rows, their digest (the Fresh's)
  at::Tensor head, host_dig;  // the meta kernel's [0] + signature and the digest's host words (pinned on a GPU)
  int dig_out = 0;            // the digest launch's ``out``: on a GPU the pinned host words (mapped), else dig
  bool head_busy = false;     // device.py HeadRow: rewritten only after a host read showed the stream past meta
  py::object failed, timed_out;  // device.py full_failed, read_timed_out (given the backend)
  // the call's plan (geometry.Plan, made as device.py dispatch makes it): its class, the first call's fields
  // (the fixed ones this call's too), those holding a list or dict (fresh empty ones per call unless set)
  py::object plan_cls, plan_fields;
  std::vector<std::pair<py::object, bool>> plan_fresh;   // (field, is a dict)
  i64 alignment = 1, node = 0, loc = 0;  // per_expert's; Wiring.count_rows' my_node and my_local_rank
  py::object reads, counters;            // Wiring.reads ([host reads]) and its counters
  c10::intrusive_ptr<c10d::ProcessGroup> group, rail;  // the count exchange's and the network's (null in tests)

  explicit InFull(py::dict d) : slots(d["slots"].cast<py::dict>()) {}

  bool launches_current() const {
    for (const LaunchP& l : {meta, digest, pack, land, recv_chan, barrier, forward})
      if (l && !l->current()) return false;
    return true;
  }

  // A host int64 tensor of n words (pinned where the device reads or writes it).
  at::Tensor host(i64 n) const {
    return at::zeros({n}, at::TensorOptions().dtype(at::kLong).pinned_memory(pinned));
  }

  // kernels.py grid: CTAs of the row kernels for n rows (a warp per row).
  i64 grid(i64 n) const { return std::max<i64>(1, std::min<i64>(max_ctas, (n + threads / 32 - 1) / (threads / 32))); }
  // fanout.py NodeFanout.grid: CTAs of a forward of J rows.
  i64 fwd_grid(i64 J) const {
    return std::max<i64>(1, std::min<i64>(fwd_ctas, (J + fwd_threads / 32 - 1) / (fwd_threads / 32)));
  }
  // geometry.chunk_rows: rows per network chunk of a stream of ``count`` rows.
  i64 chunk_rows(i64 count) const { return std::max<i64>({1, ring, (count + Kc - 1) / Kc}); }
};

using InFullP = std::shared_ptr<InFull>;

InFullP make_in_full(py::dict d) {
  auto f = std::make_shared<InFull>(d);
  f->owner = d["owner"].ptr();
  f->fresh = d["fresh"];
  f->meta = d["meta"].cast<LaunchP>();
  f->digest = d["digest"].cast<LaunchP>();
  f->pack = d["pack"].cast<LaunchP>();
  f->land = d["land"].cast<LaunchP>();
  f->recv_chan = d["recv_chan"].cast<LaunchP>();
  if (!f->meta || !f->digest || !f->pack || !f->land || !f->recv_chan)
    throw std::invalid_argument("InFull: every kept launch (meta, digest, pack, land, recv_chan) is needed");
  f->sig = d["sig"].cast<std::vector<i64>>();
  f->E = d["num_experts"].cast<i64>();
  if (f->sig.size() < 2) throw std::invalid_argument("InFull: the signature has no call word");
  for (auto [n, v] : {std::pair<const char*, i64*>{"M", &f->M}, {"P", &f->P}, {"Kc", &f->Kc}, {"Lx", &f->Lx},
                      {"T", &f->T}, {"H", &f->H}, {"C", &f->C}, {"K", &f->K}, {"W", &f->W}, {"scales", &f->S},
                      {"threads", &f->threads}, {"max_ctas", &f->max_ctas}})
    *v = d[n].cast<i64>();
  for (auto [n, v] : {std::pair<const char*, i64*>{"ring", &f->ring}, {"area_row", &f->area_row},
                      {"fwd_threads", &f->fwd_threads}, {"fwd_ctas", &f->fwd_ctas}})
    *v = d[n].cast<i64>();
  if (f->P > 1) {
    f->barrier = d["barrier"].cast<LaunchP>();
    f->forward = d["forward"].cast<LaunchP>();
    std::tie(f->fwd_landed, f->fwd_j, f->fwd_pos, f->fwd_sync) = d["fwd_slots"].cast<std::tuple<int, int, int, int>>();
    f->side.parse(d["two"]);
  }
  if (f->P < 1 || f->Kc < 1 || f->K <= 0 || f->threads < 32 || f->fwd_threads < 32 || f->fwd_ctas < 1 ||
      (f->P > 1 && (!f->barrier || !f->forward)))
    throw std::invalid_argument("InFull: top-k only; the forwarder's barrier and forward where P > 1");
  f->weights = d["weights"].cast<bool>();
  f->pinned = d["pinned"].cast<bool>();
  f->dtype = d["dtype"].cast<at::ScalarType>();
  auto ends = d["ends"].cast<std::vector<i64>>();
  if (ends.size() != 5) throw std::invalid_argument("InFull: five block offsets");
  std::copy(ends.begin(), ends.end(), f->ends);
  f->row = d["row"].cast<at::Tensor>();
  f->g = d["g"].cast<at::Tensor>();
  f->dig = d["dig"].cast<at::Tensor>();
  if (f->dig.scalar_type() != at::kLong || f->dig.numel() < Digest::length(f->M, f->P, f->Kc, f->Lx) ||
      !f->dig.is_contiguous())
    throw std::invalid_argument("InFull: the digest is not int64 of its layout");
  f->host_dig = f->host(f->dig.numel());
  f->dig_out = f->digest->slot("out", 'Q');
  f->plan_cls = d["plan_cls"];
  f->plan_fields = d["plan_fields"];
  for (auto [k, v] : f->plan_fields.cast<py::dict>())
    if (PyList_CheckExact(v.ptr()) || PyDict_CheckExact(v.ptr()))
      f->plan_fresh.emplace_back(py::reinterpret_borrow<py::object>(k), PyDict_CheckExact(v.ptr()));
  f->alignment = d["alignment"].cast<i64>();
  f->node = d["node"].cast<i64>();
  f->loc = d["loc"].cast<i64>();
  f->reads = d["reads"];
  f->counters = d["counters"];
  if (!PyList_CheckExact(f->reads.ptr()) || PyList_GET_SIZE(f->reads.ptr()) < 1 ||
      !PyDict_CheckExact(f->counters.ptr()) || f->alignment < 1)
    throw std::invalid_argument("InFull: reads a list, counters a dict, alignment >= 1");
  f->failed = d["failed"];
  f->timed_out = d["timed_out"];
  if (!d["group"].is_none()) f->group = d["group"].cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
  if (!d["rail"].is_none()) f->rail = d["rail"].cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
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
  i64 full_found = 0;     // non-cached dispatches that matched a kept one and passed the checks
  void* read_event = nullptr;   // the digest read's event (made by its first record)
  i64 wait_ns = 0;        // host time in the digest read's wait (the device's earlier work, the peers): benchmarks
  Clock::time_point served_at{};   // phases on: when the last served non-cached dispatch returned

  py::object sync_mode = py::none();   // torch._C._cuda_get_sync_debug_mode (None: this torch has no CUDA)

  explicit InEngine(py::dict s) : Core(s, {kCached, kCombine, kDispatch}), make_twin(s["make_twin"]) {
    py::object c = py::module_::import("torch._C");
    if (py::hasattr(c, "_cuda_get_sync_debug_mode")) sync_mode = c.attr("_cuda_get_sync_debug_mode");
  }
  ~InEngine() override {   // (as c10::Event's destructor does: a failure there is a warning)
    if (read_event && impl) impl->destroyEvent(read_event, static_cast<c10::DeviceIndex>(dev));
  }

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

  // ``steps``' launches on the comm stream (or ``raw``) with this call's addresses; their time is phase ``phase``.
  void issue(const std::vector<Step>& steps, const u64* src, Phases& ph, const char* phase, u64 raw = 0) {
    if (steps.empty()) return;
    for (const Step& s : steps) {
      Launch& l = *s.launch;
      for (auto& sl : s.slots) l.set(static_cast<int>(sl[0]), src[sl[1]] + static_cast<u64>(sl[2]));
      l.issue(raw ? raw : comm.raw);
    }
    ph.mark(phase);
  }

  // network.py _two_streams (a dispatch with the forwarder, ``ss`` set, n > 1): the side stream forks from
  // the comm stream; chunk k's collective (``post(k)``, NCCL on the current stream, ordered there) and its
  // forward (``after(k, raw)``) run on chunk_side's stream; the comm stream joins the side one before the
  // last forward. The comm stream current again at the end, also after an error.
  template <class Post, class After>
  void two_streams(i64 n, const SideStream& ss, Post post, After after) {
    Stream side{test ? c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::kCPU))
                     : c10::Stream::unpack3(ss.id, static_cast<c10::DeviceIndex>(dev), c10::kCUDA),
                test ? comm.raw + 1 : ss.raw};
    if (test) record(py::make_tuple("fork", comm.raw, side.raw));
    else {
      event_record(ss.fork_ev, comm);
      event_wait(ss.fork_ev, side);
    }
    struct Back {
      Core& e;
      ~Back() { if (!e.test) e.impl->exchangeStream(e.comm.c); }
    } back{*this};
    for (i64 k = 0; k < n; ++k) {
      const Stream& s = chunk_side(k, n) ? side : comm;
      if (!test) impl->exchangeStream(s.c);
      post(k);
      if (k == n - 1) {
        if (test) record(py::make_tuple("join", side.raw, comm.raw));
        else {
          event_record(ss.join_ev, side);
          event_wait(ss.join_ev, comm);
        }
      }
      after(k, s.raw);
    }
  }

  // One network chunk: the rail all-to-all of ``send`` into ``out`` on ``group`` (null in tests: recorded
  // only), issued on the current stream (the comm stream). ``sync``: ordered there, so no work to wait for.
  c10::intrusive_ptr<c10d::Work> post(c10d::ProcessGroup* group, at::Tensor& out, at::Tensor& send,
                                      std::vector<i64>& out_splits, std::vector<i64>& in_splits, bool sync) {
    if (test)
      record(py::make_tuple("a2a", address(out), address(send), py::tuple(py::cast(out_splits)),
                            py::tuple(py::cast(in_splits))));
    if (!group) return {};
    auto t0 = Clock::now();
    auto work = alltoall(*group, out, send, out_splits, in_splits, sync);
    nccl_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
    return sync ? c10::intrusive_ptr<c10d::Work>() : work;
  }

  // The current (comm) stream waits for a posted chunk (NCCL: no host wait); ``sync`` chunks ran on it,
  // in its order: nothing to wait for.
  void land(bool sync, const c10::intrusive_ptr<c10d::Work>& work) {
    if (sync) return;
    if (test) record(py::make_tuple("a2a_wait"));
    if (!work) return;
    auto t0 = Clock::now();
    work->wait();
    nccl_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
  }

  // network.py stream: the chunk loop of every call. Chunk k: ``before(k)`` (a node step making its rows),
  // ``post(k)``, and once it landed ``after(k)`` (a node step on what landed). Chunk k + 1 is posted before
  // chunk k is waited for; ``each``: every chunk is waited for (a node step after it, or a network that
  // may complete chunks out of order), else only the last.
  template <class Before, class Post, class Land, class After>
  static void stream(i64 n, bool each, Before before, Post post, Land land, After after) {
    c10::intrusive_ptr<c10d::Work> posted;
    for (i64 k = 0; k < n; ++k) {
      before(k);
      auto next = post(k);
      if (k && each) {
        land(posted);
        after(k - 1);
      }
      posted = std::move(next);
    }
    if (n) {
      land(posted);
      after(n - 1);
    }
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
      at::Tensor scratch = p.scratch.defined() ? p.scratch : empty({p.rows, p.width}, at::kByte);
      ph.mark("scratch");
      u64 src[kNumSources] = {address(tensor(xo)), second.is_none() ? 0 : address(tensor(second)), address(out1),
                              p.out.two ? address(out2) : 0, address(scratch), 0};
      if (test) record(py::make_tuple("scratch", src[kScratch], p.rows * p.width));
      if (p.uses_area) {   // (the plan's rows fit: its first call reserved them, and areas only grow)
        i64 a = settled_area(backend, 0);
        if (a < 0) {
          ++py_ops.call;
          a = as_int(attr(attr(backend, NI->node), NI->area_address)());
        }
        src[kArea] = static_cast<u64>(a);
        ph.mark("area");
      }
      issue(p.pre, src, ph, "pre");
      auto post_k = [&](i64 k, bool on_stream) {   // the chunk's rows as tensors carved without the dispatcher
        Chunk& c = p.chunks[k];                    // (scratch.narrow's views)
        at::Tensor send = carve(scratch, c.send_row * p.width, {c.send_rows, p.width}, at::kByte),
                   out = carve(scratch, c.out_row * p.width, {c.out_rows, p.width}, at::kByte);
        auto work = post(p.group.get(), out, send, c.out_splits, c.in_splits, on_stream);
        ph.mark("a2a");
        return work;
      };
      if (p.side.set && p.chunks.size() > 1)
        two_streams(
            static_cast<i64>(p.chunks.size()), p.side, [&](i64 k) { post_k(k, true); },
            [&](i64 k, u64 raw) { issue(p.chunks[k].node, src, ph, "node", raw); });
      else stream(
          static_cast<i64>(p.chunks.size()), p.node_after || !p.ordered,
          [&](i64 k) {
            if (!p.node_after) issue(p.chunks[k].node, src, ph, "node");
          },
          [&](i64 k) { return post_k(k, p.sync); },
          [&](const c10::intrusive_ptr<c10d::Work>& work) {
            land(p.sync, work);
            ph.mark("wait");
          },
          [&](i64 k) {
            if (p.node_after) issue(p.chunks[k].node, src, ph, "node");
          });
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
    // the twin's shapes are this call's (T, H, dtype, top-k, weights, scales)
    if (d.size(0) != twin->T || d.size(1) != twin->H || d.scalar_type() != twin->dtype ||
        e->topk.shape.size() != 2 || e->topk.shape[1] != twin->K || e->w.present != twin->weights ||
        a.x_tuple != (twin->S >= 0))
      return false;
    e->twin = std::move(twin);
    keep_entry(full, std::move(e), handle);
    return true;
  }

  // This rank's forwarder area address where every area already holds ``need`` bytes (node.fan.settled:
  // (capacity, address) as the areas' last opening left them, None while closed), read without a call into
  // Python; -1 where the node's reserve (or area_address) must run.
  static i64 settled_area(py::handle backend, i64 need) {
    py::object s = attr(attr(attr(backend, NI->node), NI->fan), NI->settled);
    if (!PyTuple_Check(s.ptr()) || PyTuple_GET_SIZE(s.ptr()) != 2) return -1;
    if (need > as_int(PyTuple_GET_ITEM(s.ptr(), 0))) return -1;
    return as_int(PyTuple_GET_ITEM(s.ptr(), 1));
  }

  // The count exchange: every rank's row into ``g`` (what Wiring.gather_into issues: the group's all-gather
  // on the current stream, the comm stream).
  void gather(InFull& t) {
    if (test) record(py::make_tuple("allgather", address(t.g), address(t.row), t.row.numel()));
    if (!t.group) return;
    auto t0 = Clock::now();
    auto work = allgather(*t.group, t.g, t.row);   // on the comm stream, the digest launch after it there
    if (work) work->wait();   // (a torch that returns one: the stream waits for it)
    nccl_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
  }

  // The host waits for the device below: said as torch says it of its own waits where
  // torch.cuda.set_sync_debug_mode asks for it (a warning, or the error), so that the count read shows
  // in that mode whichever path made it.
  void synchronizing() {
    if (sync_mode.is_none()) return;
    const i64 mode = as_int(sync_mode());
    if (mode == 1) {
      if (PyErr_WarnEx(PyExc_UserWarning, "called a synchronizing CUDA operation", 1) < 0) throw py::error_already_set();
    } else if (mode >= 2) {
      throw std::runtime_error("called a synchronizing CUDA operation");
    }
  }

  // The digest's one host read (Wiring.read_counts): on a GPU the digest kernel wrote the pinned host words
  // itself (no copy to issue); an event after it on the comm stream, then a host wait with the GIL released,
  // bounded by the Buffer's timeout; a device error is raised as torch's.
  std::vector<i64> read_digest(py::handle backend, InFull& t, Phases& ph) {
    const i64 n = t.dig.numel();
    std::vector<i64> out(n);
    synchronizing();
    if (test) {   // no device: the digest tensor holds what the test put there (the marks as on a device)
      record(py::make_tuple("read", address(t.dig), n * 8));
      for (const char* m : {"read_event", "read_wait"}) ph.mark(m);
      std::memcpy(out.data(), t.dig.data_ptr(), n * 8);
      ph.mark("read_host");
      return out;
    }
    if (!t.pinned) t.host_dig.copy_(t.dig, /*non_blocking=*/true);   // (a twin's host words are pinned on a GPU)
    impl->record(&read_event, comm.c, static_cast<c10::DeviceIndex>(dev), c10::EventFlag::PYTORCH_DEFAULT);
    ph.mark("read_event");
    int status = 0;   // 1: past the timeout; 2: the device's error
    std::exception_ptr error;
    auto t0 = Clock::now();
    {
      py::gil_scoped_release unlocked;
      const auto limit = std::chrono::nanoseconds(timeout_ns);
      for (u64 spins = 0;; ++spins) {
        if ((spins & 63) == 0) {
          try {
            if (impl->queryEvent(read_event)) break;
          } catch (...) {
            error = std::current_exception();
            status = 2;
            break;
          }
          if (Clock::now() - t0 > limit) {
            status = 1;
            break;
          }
        }
        cpu_pause();
      }
    }
    wait_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
    ph.mark("read_wait");
    if (status == 2) std::rethrow_exception(error);
    if (status == 1) {
      ++py_ops.call;
      t.timed_out(backend, static_cast<double>(timeout_ns) / 1e9);
      throw std::runtime_error("read_timed_out returned");   // it raises
    }
    std::atomic_thread_fence(std::memory_order_acquire);
    std::memcpy(out.data(), t.host_dig.data_ptr(), n * 8);
    ph.mark("read_host");
    return out;
  }

  static void set_item(py::handle d, PyObject* key, py::handle v) {
    if (PyDict_SetItem(d.ptr(), key, v.ptr()) < 0) throw py::error_already_set();
  }

  // geometry.geometry: every stream of the digest cut into its chunks (chunk k of a stream of c rows:
  // geometry.clip of chunk_rows(c)), each chunk's rows to and from every rail peer, their first rows.
  struct Chunks {
    std::vector<std::vector<i64>> send, recv;   // [num_chunks][M]
    std::vector<i64> send_starts{0}, recv_starts{0};
    Chunks(const InFull& t, const Digest& d) {
      auto cut = [&](const std::vector<i64>& counts, i64 k) {
        std::vector<i64> out;
        for (i64 c : counts) {
          const i64 rows = t.chunk_rows(c);
          out.push_back(std::max<i64>(0, std::min<i64>(rows, c - k * rows)));
        }
        return out;
      };
      for (i64 k = 0; k < d.num_chunks; ++k) {
        send.push_back(d.num_chunks == 1 ? d.mine : cut(d.mine, k));
        recv.push_back(d.num_chunks == 1 ? d.rail_in : cut(d.rail_in, k));
        send_starts.push_back(send_starts.back() + std::accumulate(send[k].begin(), send[k].end(), i64{0}));
        recv_starts.push_back(recv_starts.back() + std::accumulate(recv[k].begin(), recv[k].end(), i64{0}));
      }
    }
  };

  // geometry.geometry's Plan of a digest cut into ``c`` with the call's slot, land_all (one rank per
  // node; else None) and landed_pos (the forwarder's; else a fresh list), its rows counted as
  // Wiring.count_rows counts them (row_counts, the counters).
  py::object make_plan(const InFull& t, const Digest& d, const Chunks& c, py::object slot, py::object land_all,
                       py::object landed_pos) {
    const i64 nch = d.num_chunks;
    py::object plan = bare_instance(t.plan_cls.ptr());
    py::dict pf = py::reinterpret_steal<py::dict>(PyDict_Copy(t.plan_fields.ptr()));
    for (auto& [k, is_dict] : t.plan_fresh)
      set_item(pf, k.ptr(), is_dict ? py::object(py::dict()) : py::object(py::list()));
    auto first = [&](const std::vector<std::vector<i64>>& v) {   // counts["fan_send"][:num_chunks]
      return py::cast(std::vector<std::vector<i64>>(v.begin(), v.begin() + nch));
    };
    set_item(pf, NI->num_chunks, int_obj(nch));
    set_item(pf, NI->num_recv, int_obj(d.num_recv));
    set_item(pf, NI->node_rows, int_obj(d.node_rows));
    set_item(pf, NI->send_splits, py::cast(c.send));
    set_item(pf, NI->recv_splits, py::cast(c.recv));
    set_item(pf, NI->send_starts, py::cast(c.send_starts));
    set_item(pf, NI->recv_starts, py::cast(c.recv_starts));
    set_item(pf, NI->fan_send, first(d.fan_send));
    set_item(pf, NI->fan_recv, first(d.fan_recv));
    set_item(pf, NI->home_lens, py::cast(d.mine));
    set_item(pf, NI->slot, slot);
    set_item(pf, NI->land_all, land_all);
    if (!landed_pos.is_none()) set_item(pf, NI->landed_pos, landed_pos);
    i64 local = 0, inter = 0, intra = 0;   // Wiring.count_rows
    for (size_t m = 0; m < d.mine.size(); ++m) (static_cast<i64>(m) == t.node ? local : inter) += d.mine[m];
    for (i64 k = 0; k < nch; ++k)
      for (size_t p = 0; p < d.fan_send[k].size(); ++p)
        (static_cast<i64>(p) == t.loc ? local : intra) += d.fan_send[k][p];
    set_item(pf, NI->row_counts, py::make_tuple(py::make_tuple(py::handle(N->local_rows), local),
                                                py::make_tuple(py::handle(NI->internode_rows), inter),
                                                py::make_tuple(py::handle(N->intranode_rows), intra)));
    set_attr(plan, N->__dict__, pf);
    add_count(t.counters, N->local_rows, local);
    add_count(t.counters, NI->internode_rows, inter);
    add_count(t.counters, N->intranode_rows, intra);
    return plan;
  }

  // Buffer.dispatch(x, num_tokens_per_rank=..., topk_idx=..., ...) like a kept one, run here as the Python
  // path runs it (backends/internode/device.py dispatch: one rank per node, or the forwarder): its 6-tuple,
  // or None (the Python path runs it; nothing was issued).
  py::object dispatch(py::handle buffer, DispatchArgs a, py::handle prev, bool async_finish, bool alloc_on_comm) {
    Phases ph("in_dispatch");
    if (phases_on && served_at.time_since_epoch().count())   // since the last served call returned: the
      ph.extra("outside", static_cast<u64>(std::chrono::duration_cast<std::chrono::nanoseconds>(   // caller's
                                               Clock::now() - served_at).count()));   // Python, the frees
    if (full.empty() || !split_dispatch(a)) return py::none();
    std::shared_ptr<InFullEntry> found;   // held: a keep_dispatch may drop it from ``full``
    for (auto& e : full)
      if (e->fits(a, buffer_type)) {
        found = e;
        break;
      }
    if (!found) return py::none();
    InFull& t = *found->twin;
    const at::Tensor& x = tensor(a.data);
    if (!x.is_contiguous() || x.get_device() != dev) return py::none();
    if (a.x_tuple) {   // the scales the transports move as they are (validate.scales_carrier)
      const at::Tensor& sc = tensor(a.scales);
      if (sc.scalar_type() != at::kFloat || sc.dim() != 2 || sc.size(1) != t.S || !sc.is_contiguous())
        return py::none();
    } else if (t.S >= 0) {
      return py::none();
    }
    py::object backend = live_backend(buffer);
    if (!backend || backend.ptr() != t.owner || !t.launches_current() || (!test && (!t.group || !t.rail)))
      return py::none();
    if (!stream_args_ok(prev, async_finish, alloc_on_comm)) return py::none();
    ++full_found;
    ph.mark("checks");

    const at::Tensor& tir = tensor(a.tir);
    const at::Tensor& topk = tensor(a.topk);
    const u64 w_addr = a.w.is_none() ? 0 : address(tensor(a.w));
    const u64 s_addr = a.x_tuple ? address(tensor(a.scales)) : 0;
    Stream compute = current();
    bool on_compute = enter(compute, prev, alloc_on_comm);
    ph.mark("enter");
    i64 calls = as_int(attr(backend, NI->calls)) + 1;   // engine.py _dispatch: the call's signature word
    set_attr(backend, NI->calls, int_obj(calls));
    t.sig[1] = calls;
    ph.mark("count");
    const FullSlots& sl = t.slots;
    const i64 R_ = R, M = t.M, T = t.T, H = t.H, C = t.C, K = t.K, Wp = t.W + 4 * t.P;
    std::vector<at::Tensor> blocks;
    at::Tensor rank_prefix, chan_prefix, recv_chan_prefix, send_head, slot, src, land_all, recv_x, recv_scales,
        recv_topk, recv_w;
    std::optional<Digest> dg;
    std::optional<Chunks> cg;
    py::object landed_pos = py::none();
    const bool fwd = t.P > 1;   // the forwarder: rows land in this rank's area, the chunks fan out in the node
    i64 S = 0, J = 0;
    {
      AllocOn on_comm(*this, comm, true);   // the comm stream current: NCCL's and the host copy's stream
      // ---- 1. metadata: one launch (the head row: [0] + signature, read through its mapped address)
      const i64 nh = 1 + static_cast<i64>(t.sig.size());
      if (t.head_busy || !t.head.defined() || t.head.numel() != nh) t.head = t.host(nh);
      i64* hw = t.head.data_ptr<i64>();
      hw[0] = 0;
      std::copy(t.sig.begin(), t.sig.end(), hw + 1);
      t.head_busy = true;
      if (test) record(py::make_tuple("head", address(t.head), nh));
      Launch& m = *t.meta;
      m.set_value(sl.meta_tir, static_cast<i64>(address(tir)));
      m.set_value(sl.meta_head, static_cast<i64>(address(t.head)));
      m.set_value(sl.meta_topk, static_cast<i64>(address(topk)));
      m.set_value(sl.meta_experts, 0);
      m.issue(comm.raw);
      ph.mark("meta");
      // ---- 2. one collective, one host read (of the gathered rows' digest)
      gather(t);
      ph.mark("exchange");
      // on a GPU the digest kernel writes the host's words itself (pinned, mapped: no copy to issue)
      t.digest->set(t.dig_out, !test && t.pinned ? address(t.host_dig) : address(t.dig));
      t.digest->issue(comm.raw);
      std::vector<i64> words = read_digest(backend, t, ph);
      Digest& d = dg.emplace(words.data(), static_cast<i64>(words.size()), M, t.P, t.Kc, t.Lx);
      if (d.error) {   // the checks raise alike on every rank (every rank read the same digest)
        ++py_ops.call;
        t.failed(backend, py::cast(t.sig));
        throw std::runtime_error("exchange_failed returned");
      }
      t.head_busy = false;   // the host read showed the stream past meta
      if (d.num_chunks > t.Kc) throw std::runtime_error("commlib internode C++ dispatch: more chunks than its cap");
      Chunks& c = cg.emplace(t, d);
      const i64 nch = d.num_chunks;
      S = c.send_starts.back();
      J = c.recv_starts.back();
      const i64 N = d.num_recv;
      ph.mark("geometry");
      // ---- 3. the allocations (Wiring.alloc: on the output stream) and the int32 views
      at::Tensor rows, block;
      {
        AllocOn out(*this, compute, on_compute);
        rows = blocks.emplace_back(empty({S + J, Wp}, at::kByte));
        // (after src: land_all [J], one rank per node; the forwarder's landed positions [J, P])
        block = blocks.emplace_back(empty({R_ * R_ + 2 * R_ * C + T * R_ + T * M + N + (fwd ? J * t.P : J)}, at::kInt));
        // the outputs: one allocation, each carved at a 256-byte boundary (callpath.h Outputs, as the
        // replays' and the NVLink dispatch's outputs are); any one of them keeps it alive
        const i64 o_scales = align_up(N * H * static_cast<i64>(c10::elementSize(t.dtype)), 256);
        const i64 o_topk = o_scales + (t.S >= 0 ? align_up(N * t.S * 4, 256) : 0);
        const i64 o_w = o_topk + align_up(N * K * 8, 256);
        const at::Tensor& outs = blocks.emplace_back(empty({o_w + (t.weights ? N * K * 4 : 0)}, at::kByte));
        recv_x = carve(outs, 0, {N, H}, t.dtype);
        if (t.S >= 0) recv_scales = carve(outs, o_scales, {N, t.S}, at::kFloat);
        recv_topk = carve(outs, o_topk, {N, K}, at::kLong);
        if (t.weights) recv_w = carve(outs, o_w, {N, K}, at::kFloat);
      }
      if (test) record(py::make_tuple("rows", address(rows), rows.numel(), "block", address(block), block.numel() * 4));
      const i64* e = t.ends;
      rank_prefix = carve(block, 0, {R_, R_}, at::kInt);
      chan_prefix = carve(block, e[0], {R_, C}, at::kInt);
      recv_chan_prefix = carve(block, e[1], {R_, C}, at::kInt);
      send_head = carve(block, e[2], {T, R_}, at::kInt);
      slot = carve(block, e[3], {T, M}, at::kInt);
      src = carve(block, e[4], {N}, at::kInt);
      // after src: one rank per node, land_all [J]; with the forwarder, the landed rows' positions [J, P]
      const i64 tail = e[4] + 4 * N;
      if (!fwd) land_all = carve(block, tail, {J}, at::kInt);
      at::Tensor send = carve(rows, 0, {S, Wp}, at::kByte), recv = carve(rows, S * Wp, {J, Wp}, at::kByte);
      const i64 b = static_cast<i64>(address(rank_prefix));
      ph.mark("alloc");
      // ---- 4. pack: the send rows and the handle's matrices
      Launch& p = *t.pack;
      p.set_value(sl.pack_tir, static_cast<i64>(address(tir)));
      p.set_value(sl.pack_x, static_cast<i64>(address(x)));
      p.set_value(sl.pack_send, static_cast<i64>(address(send)));
      p.set_value(sl.pack_rank_prefix, b);
      p.set_value(sl.pack_chan_prefix, b + e[0]);
      p.set_value(sl.pack_send_head, b + e[2]);
      p.set_value(sl.pack_slot, b + e[3]);
      p.set_value(sl.pack_scales, static_cast<i64>(s_addr));
      p.set_value(sl.pack_topk, static_cast<i64>(address(topk)));
      p.set_value(sl.pack_w, static_cast<i64>(w_addr));
      p.issue(comm.raw);
      ph.mark("pack");
      // ---- 5. the network chunks (the rail all-to-all), with the forwarder their fan-out in the node
      // (device.py move, node.py ForwarderNode, network.py stream: chunk k + 1 on the wire while chunk k is
      // fanned out; with the forwarder on two streams, else chunk k waited for first; one chunk on the current
      // stream, nothing to wait for)
      i64 area = 0;
      if (fwd) {   // dispatch_begin: room for the node's rows in every area (collective where they grow); the
        area = settled_area(backend, d.node_rows * t.area_row);   // barrier before the forwards is the pack's
        if (area < 0) {                                          // (every local rank reads the same digest:
          ++py_ops.call;                                         // all of them fit, or all call reserve)
          area = as_int(attr(attr(backend, NI->node), NI->reserve)(d.node_rows, t.area_row));
        }
        ph.mark("reserve");
      }
      auto post_k = [&](i64 k, bool on_stream) {
        at::Tensor send_k = carve(rows, c.send_starts[k] * Wp, {c.send_starts[k + 1] - c.send_starts[k], Wp},
                                  at::kByte),
                   recv_k = carve(rows, (S + c.recv_starts[k]) * Wp, {c.recv_starts[k + 1] - c.recv_starts[k], Wp},
                                  at::kByte);
        auto work = post(t.rail.get(), recv_k, send_k, c.recv[k], c.send[k], on_stream);
        ph.mark("a2a");
        return work;
      };
      // dispatch_chunk: the landed chunk's rows forwarded, their positions stored into the block; the pack
      // arrived at the node barrier before the stores, the first forward of each stream waits for it, the
      // last takes the barrier after them (fanout.py two_stream_syncs; no launch for no rows and no flags)
      auto forward_k = [&](i64 k, u64 raw) {
        const i64 Jk = c.recv_starts[k + 1] - c.recv_starts[k], sync = two_stream_sync(k, nch);
        if (!fwd || (!Jk && !sync)) return;
        Launch& f = *t.forward;
        f.set_value(t.fwd_landed, static_cast<i64>(address(recv)) + c.recv_starts[k] * Wp);
        f.set_value(t.fwd_j, Jk);
        f.set_value(t.fwd_pos, b + tail + 4 * t.P * c.recv_starts[k]);
        f.set_value(t.fwd_sync, sync);
        f.grid = static_cast<unsigned>(t.fwd_grid(Jk));
        f.issue(raw);
        ph.mark("forward");
      };
      if (fwd && t.side.set && nch > 1) {   // the chunks on two streams (network.py stream's ``sides``)
        two_streams(nch, t.side, [&](i64 k) { post_k(k, true); }, forward_k);
      } else {
        const bool sync = nch == 1;
        stream(   // (one rank per node: NCCL completes the chunks in order, the last one's wait covers all)
            nch, fwd, [](i64) {}, [&](i64 k) { return post_k(k, sync); },
            [&](const c10::intrusive_ptr<c10d::Work>& work) {
              land(sync, work);
              ph.mark("chunk_wait");
            },
            [&](i64 k) { forward_k(k, comm.raw); });
      }
      if (fwd) {   // finish_forward (no chunks: the barrier no forward took); the landed rows' positions on
        if (!nch) t.barrier->issue(comm.raw);   // every local rank (combine's sources, stored by the forward
        ph.mark("barrier");                      // kernel into the block) as the plan's per-chunk views
        py::list lp;
        for (i64 k = 0; k < nch; ++k)
          lp.append(wrap(carve(block, tail + 4 * t.P * c.recv_starts[k],
                               {c.recv_starts[k + 1] - c.recv_starts[k], t.P}, at::kInt)));
        landed_pos = std::move(lp);
        ph.mark("landed_pos");
      }
      const i64 n_rows = fwd ? N : J;   // what land reads: this rank's area (its final rows), else the landed rows
      if (n_rows) {
        Launch& l = *t.land;
        l.set_value(sl.land_rows, fwd ? area : static_cast<i64>(address(recv)));
        l.set_value(sl.land_n, n_rows);
        l.set_value(sl.land_n_out, N);
        l.set_value(sl.land_x, static_cast<i64>(address(recv_x)));
        l.set_value(sl.land_src, b + e[4]);
        l.set_value(sl.land_scales, t.S >= 0 ? static_cast<i64>(address(recv_scales)) : 0);
        l.set_value(sl.land_topk, static_cast<i64>(address(recv_topk)));
        l.set_value(sl.land_w, t.weights ? static_cast<i64>(address(recv_w)) : 0);
        l.set_value(sl.land_pos, fwd ? 0 : b + tail);
        l.grid = static_cast<unsigned>(t.grid(n_rows));
        l.issue(comm.raw);
      }
      Launch& rc = *t.recv_chan;
      rc.set_value(sl.recv_chan_src, b + e[4]);
      rc.set_value(sl.recv_chan_out, b + e[1]);
      rc.issue(comm.raw);
      ph.mark("land");
    }
    // ---- 6. the plan, the rows counted, the handle: as device.py dispatch makes them (no call into Python)
    const Digest& d = *dg;
    const i64 n_recv = d.num_recv;
    PyObject* reads = t.reads.ptr();                // Wiring.read_counts' read: reads[0] += 1
    if (PyList_SetItem(reads, 0, int_obj(as_int(PyList_GET_ITEM(reads, 0)) + 1).release().ptr()) < 0)
      throw py::error_already_set();
    py::object plan = make_plan(t, d, *cg, wrap(slot), fwd ? py::object(py::none()) : wrap(land_all), landed_pos);
    py::object h = bare_instance(G.handle);   // device.py make_handle
    py::dict hf = py::reinterpret_steal<py::dict>(PyDict_Copy(found->handle_template.ptr()));
    py::dict extra;
    set_item(extra, NI->plan, plan);
    set_item(extra, NI->num_recv, int_obj(n_recv));
    set_item(hf, N->rank_prefix_matrix, wrap(rank_prefix));
    set_item(hf, N->channel_prefix_matrix, wrap(chan_prefix));
    set_item(hf, N->recv_channel_prefix_matrix, wrap(recv_chan_prefix));
    set_item(hf, N->recv_src_idx, wrap(src));
    set_item(hf, N->is_token_in_rank, a.tir);
    set_item(hf, N->send_head, wrap(send_head));
    set_item(hf, N->num_recv_tokens, int_obj(n_recv));
    set_item(hf, N->extra, extra);
    set_item(hf, N->buffer_id, attr(buffer, N->buffer_id));
    set_attr(h, N->__dict__, hf);
    py::list per_expert(d.experts.size());   // device.py per_expert
    for (size_t i = 0; i < d.experts.size(); ++i) per_expert[i] = int_obj(align_up(d.experts[i], t.alignment));
    ++served_n[kDispatch];
    ph.mark("handle");
    py::object overlap = leave(compute, blocks, dispatch_inputs(a), async_finish, on_compute);
    ph.mark("leave");
    py::object rx = wrap(std::move(recv_x));
    py::object recv_out = a.x_tuple ? py::object(py::make_tuple(rx, wrap(std::move(recv_scales)))) : rx;
    py::object result = py::make_tuple(recv_out, wrap(std::move(recv_topk)),
                                       t.weights ? wrap(std::move(recv_w)) : py::none(), per_expert, h, overlap);
    ph.mark("result");
    if (phases_on) served_at = Clock::now();
    return result;
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
  m.def("_allgather", [](py::object group, at::Tensor out, at::Tensor in) {
    // tests: the count exchange as the engine issues it (c10d from C++), waited for
    auto pg = group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
    auto work = allgather(*pg, out, in);
    if (work) work->wait();
  });
  m.def("_parse_digest", [](std::vector<i64> d, i64 M, i64 P, i64 Kc, i64 Lx) {
    // tests: the digest parse the dispatch runs, against exchange.parse_digest
    return Digest(d.data(), static_cast<i64>(d.size()), M, P, Kc, Lx).dict();
  });
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
      .def_readonly("wait_ns", &InEngine::wait_ns)
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
