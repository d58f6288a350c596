"""commlib.tuning.autotune: keying, the on-disk cache (corrupt / foreign files, concurrent writers), the search
(smart within 3% of the exhaustive best for <= 25% of its time, on the benchmark's cost model),
the noise rule, autotune / get_config, and one spawned 2-rank gloo world for rank agreement and the
CLI worker on the real Buffer."""
import dataclasses
import json
import multiprocessing as mp
import os
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from commlib.tuning import autotune as tune
from commlib.config import Config, default_combine_config, default_dispatch_config
from commlib.topology import Topology
from commlib.tuning.search import SINGLE_NODE_RDMA
from worlds import run_world

REPO = Path(__file__).resolve().parent.parent


from benchmarks import bench_tune as bench


def key(**overrides):
    fields = dict(num_ranks=2, ranks_per_node=2, hidden=7168, dtype="bf16", num_tokens=4096,
                  gpu="NVIDIA H200", topology="2gpu:NV18:abcd")
    fields.update(overrides)
    return tune.make_key(**fields)


def fields_of(config):
    return dataclasses.astuple(config)


# ------------------------------------------------------------------------------------------ keys
@pytest.mark.parametrize("n, bucket", [(0, 1), (1, 1), (2, 2), (3, 4), (128, 128), (129, 256), (4096, 4096),
                                       (4097, 8192)])
def test_token_bucket(n, bucket):
    assert tune.token_bucket(n) == bucket


def test_dtype_names():
    for spelling in (torch.bfloat16, "bf16", "bfloat16", "torch.bfloat16"):
        assert tune.dtype_name(spelling) == "bfloat16"
    for spelling in (torch.float8_e4m3fn, "fp8", "e4m3"):
        assert tune.dtype_name(spelling) == "float8_e4m3fn"
    assert tune.dtype_bytes("fp8") == 1 and tune.dtype_bytes(torch.bfloat16) == 2
    with pytest.raises(ValueError, match="unsupported dtype"):
        tune.dtype_name(torch.int32)


def test_key_fields_all_matter():
    base = key()
    assert key(dtype=torch.bfloat16) == base                 # spelling does not matter
    assert key(num_tokens=3000) == base                      # same power-of-two bucket
    variants = [key(num_tokens=4097), key(dtype="fp8"), key(hidden=4096), key(num_ranks=4, ranks_per_node=4),
                key(num_ranks=4, ranks_per_node=2), key(gpu="NVIDIA H100"), key(topology="2gpu:PIX:0000")]
    ids = {v.id for v in variants} | {base.id}
    assert len(ids) == len(variants) + 1


def test_machine_off_gpu():
    assert tune.machine(None) == ("cpu", "cpu")
    assert tune.machine("cpu") == ("cpu", "cpu")
    k = tune.make_key(2, 2, 7168, "bf16", 100, torch.device("cpu"))
    assert (k.gpu, k.topology, k.token_bucket) == ("cpu", "cpu", 128)


def test_parse_topology():
    text = ("\x1b[4m\tGPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity\x1b[0m\n"
            "GPU0\t X \tNV18\tSYS\t0-47\t0\nGPU1\tNV18\t X \tSYS\t0-47\t0\n"
            "NIC0\tSYS\tSYS\t X \n\nLegend:\n  X = Self\n")
    topo = tune.parse_topology(text)
    assert topo.startswith("2gpu:NV18:")
    assert tune.parse_topology(text.replace("NV18", "PIX")) != topo
    assert tune.parse_topology("") is None
    assert tune.parse_topology("No devices were found") is None


# ----------------------------------------------------------------------------------------- cache
def test_store_lookup_roundtrip(tmp_path):
    path = str(tmp_path / "t.json")
    cfg = Config(24, 16, 512, 64, 1024)
    assert tune.lookup("dispatch", key(), path) is None          # no file
    assert tune.store("dispatch", key(), cfg, path, time=123.0)
    assert tune.lookup("dispatch", key(), path) == cfg
    assert tune.lookup("dispatch", key(num_tokens=3000), path) == cfg  # same bucket
    assert tune.lookup("combine", key(), path) is None
    assert tune.lookup("dispatch", key(num_tokens=8192), path) is None
    assert tune.lookup("dispatch", key(gpu="NVIDIA H100"), path) is None
    doc = json.loads(Path(path).read_text())
    assert doc["schema"] == tune.SCHEMA and doc["version"] == tune.VERSION
    (entry,) = doc["entries"].values()
    assert entry["config"]["num_sms"] == 24 and entry["time"] == 123.0 and entry["kind"] == "dispatch"
    with pytest.raises(ValueError, match="kind"):
        tune.lookup("gather", key(), path)


def test_cache_path_resolution(tmp_path, monkeypatch):
    monkeypatch.delenv("COMMLIB_TUNING_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tune.cache_path() == str(tmp_path / "xdg" / "commlib" / "tuning.json")
    monkeypatch.setenv("COMMLIB_TUNING_CACHE", str(tmp_path / "elsewhere.json"))
    assert tune.cache_path() == str(tmp_path / "elsewhere.json")
    assert tune.cache_path(str(tmp_path / "explicit.json")) == str(tmp_path / "explicit.json")
    tune.store("combine", key(), Config(), None)          # goes where the variable says
    assert (tmp_path / "elsewhere.json").exists()


def test_cached_config(tmp_path, monkeypatch):
    path = str(tmp_path / "t.json")
    monkeypatch.setenv("COMMLIB_TUNING_CACHE", path)
    args = dict(kind="dispatch", num_ranks=2, ranks_per_node=2, hidden=7168, dtype="bf16", device=torch.device("cpu"))
    assert tune.cached_config(num_tokens=4096, **args) is None
    assert not os.path.exists(path)                        # a lookup never creates the file
    cpu_key = tune.make_key(2, 2, 7168, "bf16", 4096, "cpu")
    cfg = Config(24, 16, 512, 64, 1024)
    tune.store("dispatch", cpu_key, cfg)
    assert tune.cached_config(num_tokens=4096, **args) == cfg
    assert tune.cached_config(num_tokens=2049, **args) == cfg
    assert tune.cached_config(num_tokens=2048, **args) is None            # other bucket
    assert tune.cached_config(num_tokens=4096, **{**args, "kind": "combine"}) is None
    # the Buffer's sizes: a config needing more than the Buffer has is not offered
    need = cfg.get_nvl_buffer_size_hint(7168 * 2, 2)
    assert tune.cached_config(num_tokens=4096, num_nvl_bytes=need, **args) == cfg
    assert tune.cached_config(num_tokens=4096, num_nvl_bytes=need - 1, **args) is None
    # rows stream through the rings: a small ring serves any token count of its bucket
    tune.store("dispatch", cpu_key, Config(8, 16, 256, 64, 1024))
    assert tune.cached_config(num_tokens=4096, **args) == Config(8, 16, 256, 64, 1024)


@pytest.mark.parametrize("content, why", [
    (b"\x00\xffnot json at all", "corrupt"),
    (b'{"schema": "commlib.tuning", "version": 1, "entries": {"a": ', "corrupt"),       # truncated
    (b'{"some": "other tool", "entries": {}}', "not a commlib tuning cache"),
    (b'[1, 2, 3]', "not a commlib tuning cache"),
    (b'{"schema": "commlib.tuning", "version": 99, "entries": {}}', "version 99"),
    (b'{"schema": "commlib.tuning", "version": 1, "entries": []}', "malformed"),
])
def test_bad_cache_file_warns_and_retunes(tmp_path, content, why):
    path = tmp_path / "t.json"
    path.write_bytes(content)
    with pytest.warns(tune.TuningCacheWarning, match=why):
        assert tune.lookup("dispatch", key(), str(path)) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")                     # warned once per file version, not per call
        assert tune.lookup("dispatch", key(), str(path)) is None
        assert tune.cached_config("dispatch", 2, 2, 7168, "bf16", 4096, path=str(path)) is None
    with pytest.warns(tune.TuningCacheWarning, match="moved it to"):
        assert tune.store("dispatch", key(), Config(), str(path))
    assert (tmp_path / "t.json.bad").read_bytes() == content  # nothing of the user's is lost
    assert tune.lookup("dispatch", key(), str(path)) == Config()


def test_invalid_entry_is_ignored(tmp_path):
    path = tmp_path / "t.json"
    tune.store("dispatch", key(), Config(), str(path))
    doc = json.loads(path.read_text())
    (name,) = doc["entries"]
    doc["entries"][name]["config"]["num_sms"] = 21          # odd: Config refuses it
    path.write_text(json.dumps(doc))
    with pytest.warns(tune.TuningCacheWarning, match="invalid"):
        assert tune.lookup("dispatch", key(), str(path)) is None


def test_unwritable_cache_warns(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")                                 # a file where the folder should be
    with pytest.warns(tune.TuningCacheWarning, match="could not write"):
        assert tune.store("dispatch", key(), Config(), str(blocker / "t.json")) is False


def _writer(path: str, proc: int, count: int) -> None:
    for i in range(count):
        tune.store("dispatch", key(hidden=1000 * (proc + 1) + i), Config(2 * (i + 1), 4, 256, 8, 256), path)
        tune.store("combine", key(), Config(2 * (proc + 1)), path)   # everyone fights over one entry


def test_concurrent_writers_lose_nothing(tmp_path):
    path = str(tmp_path / "t.json")
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    procs, count = 4, 15
    workers = [ctx.Process(target=_writer, args=(path, p, count)) for p in range(procs)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert [w.exitcode for w in workers] == [0] * procs
    doc = json.loads(Path(path).read_text())
    assert len(doc["entries"]) == procs * count + 1
    for p in range(procs):
        for i in range(count):
            assert tune.lookup("dispatch", key(hidden=1000 * (p + 1) + i), path) == Config(2 * (i + 1), 4, 256, 8, 256)
    assert tune.lookup("combine", key(), path).num_sms in {2 * (p + 1) for p in range(procs)}
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


# ----------------------------------------------------------------------------------------- space
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sms=st.lists(st.integers(1, 40), min_size=1, max_size=5, unique=True),
       send=st.lists(st.integers(1, 96), min_size=1, max_size=4, unique=True),
       recv=st.lists(st.sampled_from([8, 32, 64, 256, 1024, 4096]), min_size=1, max_size=3, unique=True),
       tokens=st.integers(0, 20000), shape=st.sampled_from([(1, 1), (2, 2), (8, 8), (4, 2), (16, 8)]),
       nvl_bytes=st.one_of(st.none(), st.integers(1 << 20, 8 << 30)), kind=st.sampled_from(tune.KINDS))
def test_space_respects_config_rules(sms, send, recv, tokens, shape, nvl_bytes, kind):
    num_ranks, rpn = shape
    space = tune.default_space(kind, num_ranks, rpn, 7168, "bf16", tokens, num_nvl_bytes=nvl_bytes,
                               num_rdma_bytes=nvl_bytes, num_sms=sms, nvl_send=send, nvl_recv=recv,
                               rdma_send=send, rdma_recv=recv)
    assert space.num_tokens == tune.token_bucket(tokens) >= tokens
    configs = space.configs()
    for c in configs:
        assert c.num_sms % 2 == 0
        assert c.num_max_nvl_chunked_send_tokens < c.num_max_nvl_chunked_recv_tokens
        assert 2 * c.num_max_rdma_chunked_send_tokens <= c.num_max_rdma_chunked_recv_tokens
        assert c.num_max_rdma_chunked_recv_tokens % c.num_max_rdma_chunked_send_tokens == 0
        if nvl_bytes is not None:
            assert c.get_nvl_buffer_size_hint(7168 * 2, rpn) <= nvl_bytes
    # complete: every legal combination is offered
    legal = 0
    for s in sms:
        for a in send:
            for b in recv:
                if s % 2 or a >= b:  # rings: any ring holds any token count
                    continue
                if nvl_bytes is None or Config(s, a, b).get_nvl_buffer_size_hint(14336, rpn) <= nvl_bytes:
                    legal += 1
    if num_ranks == rpn:
        assert len(configs) == legal


# ---------------------------------------------------------------------------------------- search
def _models(kind, T, world, seed):
    make = lambda noise_seed: bench.SimulatedWorkload(kind, T, 7168, num_ranks=world, seed=seed,  # noqa: E731
                                                      noise_seed=noise_seed)
    return make(1000 + seed), make(2000 + seed), make(0)


@pytest.mark.parametrize("kind, T, world, seed", [
    ("dispatch", 4096, 2, 0), ("dispatch", 4096, 2, 1), ("dispatch", 4096, 2, 2),
    ("combine", 4096, 2, 0), ("combine", 4096, 2, 1),
    ("dispatch", 1024, 8, 0), ("combine", 128, 2, 3),
])
def test_smart_matches_exhaustive_for_a_quarter_of_the_time(kind, T, world, seed):
    """V3 workload on the cost model: within 3% of the exhaustive best, <= 25% of its time and batches."""
    space = tune.default_space(kind, world, world, 7168, "bf16", T)
    default = (default_dispatch_config if kind == "dispatch" else default_combine_config)(world, 20)
    m_exh, m_smart, truth = _models(kind, T, world, seed)
    exh = tune.search(space, m_exh, default=default, strategy="exhaustive")
    smart = tune.search(space, m_smart, default=default, strategy="smart")
    assert exh.num_batches >= len(space.configs()) * 4
    assert truth.true_time(smart.best) <= 1.03 * truth.true_time(exh.best)
    assert m_smart.elapsed <= 0.25 * m_exh.elapsed
    assert smart.num_batches <= 0.25 * exh.num_batches
    assert smart.spent <= 0.25 * exh.spent
    best_trial = next(t for t in smart.trials if t.config == smart.best)
    assert len(best_trial.samples) == 4 * m_smart.reps   # the winner is measured as fully as in the sweep


def test_search_only_times_the_space():
    space = tune.default_space("dispatch", 2, 2, 7168, "bf16", 4096)
    legal = {fields_of(c) for c in space.configs()}
    seen = []
    model = bench.SimulatedWorkload("dispatch", 4096, 7168)

    def time_fn(config):
        seen.append(fields_of(config))
        return model(config)

    res = tune.search(space, time_fn, default=Config(20, 32, 1024, *SINGLE_NODE_RDMA))
    assert set(seen) <= legal
    assert res.num_batches == len(seen)


def _flat(value, spread=0.01, seed=0):
    rng = __import__("random").Random(seed)
    return lambda config: [value(config) * (1 + rng.gauss(0, spread)) for _ in range(5)]


def test_default_kept_when_gain_is_within_noise():
    space = [Config(s, k) for s in (8, 16, 20, 24, 32) for k in (8, 16, 32)]
    default = Config(20, 32)
    res = tune.search(space, _flat(lambda c: 100.0), default=default)
    assert res.config == default and not res.replaced
    # 0.5% faster, 1% sample noise: still within the noise
    res = tune.search(space, _flat(lambda c: 99.5 if c.num_sms == 24 else 100.0), default=default)
    assert res.config == default and not res.replaced
    assert res.margin > 0


def test_default_replaced_by_a_clear_winner():
    space = [Config(s, k) for s in (8, 16, 20, 24, 32) for k in (8, 16, 32)]
    default = Config(20, 32)
    # a smooth bowl (what the smart search assumes) with its bottom at (24, 8), 20% below the default
    bowl = lambda c: 80.0 + abs(c.num_sms - 24) + 0.5 * abs(c.num_max_nvl_chunked_send_tokens - 8)  # noqa: E731
    res = tune.search(space, _flat(bowl), default=default)
    assert res.replaced and res.config == Config(24, 8) and res.best == Config(24, 8)
    assert res.speedup == pytest.approx(bowl(default) / 80.0, rel=0.05)
    assert "<- winner" in res.table() and "(default)" in res.table()
    # an isolated needle: only the sweep is sure to find it
    needle = lambda c: 80.0 if (c.num_sms, c.num_max_nvl_chunked_send_tokens) == (16, 16) else 100.0  # noqa: E731
    res = tune.search(space, _flat(needle), default=default, strategy="exhaustive")
    assert res.replaced and res.config == Config(16, 16)


def test_failing_configs_are_skipped():
    space = [Config(s, k) for s in (8, 16, 24) for k in (8, 16)]

    def time_fn(config):
        if config.num_sms == 8:
            raise RuntimeError("kernel timed out")
        return [float(config.num_sms + config.num_max_nvl_chunked_send_tokens)] * 3

    with pytest.warns(RuntimeWarning, match="kernel timed out"):
        res = tune.search(space, time_fn, strategy="exhaustive")
    assert res.best == Config(16, 8)
    assert sum(t.error is not None for t in res.trials) == 2
    assert "2 configs failed" in res.table(top=None)
    with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match="no candidate"):
        tune.search(space, lambda c: (_ for _ in ()).throw(ValueError("nope")))
    with pytest.raises(ValueError, match="empty"):
        tune.search(tune.default_space("dispatch", 2, 2, 7168, "bf16", 1 << 20, num_sms=(8,), num_nvl_bytes=1),
                    time_fn)  # no ring fits one byte


def test_progress_reports_every_batch():
    calls = []
    space = tune.default_space("dispatch", 2, 2, 7168, "bf16", 4096)
    res = tune.search(space, bench.SimulatedWorkload("dispatch", 4096, 7168), default=Config(),
                      progress=lambda done, total, best: calls.append((done, total, best)))
    assert [c[0] for c in calls] == list(range(1, res.num_batches + 1))
    assert all(done <= total for done, total, _ in calls)
    assert calls[-1][2] == pytest.approx(min(t.median for t in res.trials))


def test_text_progress(capsys):
    import io
    out = io.StringIO()
    bar = tune.TextProgress("dispatch T=4096", stream=out)
    for i in range(1, 5):
        bar(i, 4, 100.0 / i)
    bar.close()
    text = out.getvalue()
    assert "[tuning] dispatch T=4096 [" in text and "4/4 best 25.0 us" in text


# ------------------------------------------------------------------------- autotune / get_config
class FakeBuffer:
    """What autotune reads from a Buffer, with no group (a single rank)."""
    group = None
    num_ranks = 2
    topology = Topology(0, 2, 2)
    device = torch.device("cpu")
    num_nvl_bytes = 2 << 30
    num_rdma_bytes = 0
    num_sms = 20


def _model_fn(kind):
    return bench.SimulatedWorkload(kind, 4096, 7168, num_ranks=2)


def test_autotune_stores_and_get_config_finds(tmp_path, monkeypatch):
    path = str(tmp_path / "t.json")
    monkeypatch.setenv("COMMLIB_TUNING_CACHE", path)
    buf = FakeBuffer()
    res = tune.autotune(buf, "dispatch", (4096, 7168), torch.bfloat16, time_fn=_model_fn("dispatch"))
    assert tune.get_config(buf, "dispatch", (4000, 7168), torch.bfloat16) == res.config
    assert tune.cached_config("dispatch", 2, 2, 7168, "bf16", 4096, torch.device("cpu")) == res.config
    entry = next(iter(json.loads(Path(path).read_text())["entries"].values()))
    assert entry["strategy"] == "smart" and entry["tuned_num_tokens"] == 4096
    assert tune.get_config(buf, "combine", (4096, 7168), torch.bfloat16) is None   # not tuned, no autotune


def test_get_config_autotunes_when_enabled(tmp_path, monkeypatch):
    monkeypatch.setenv("COMMLIB_TUNING_CACHE", str(tmp_path / "t.json"))
    monkeypatch.setenv("COMMLIB_AUTOTUNE", "1")
    buf = FakeBuffer()
    model = _model_fn("combine")
    cfg = tune.get_config(buf, "combine", (4096, 7168), "bf16", time_fn=model)
    assert isinstance(cfg, Config) and model.calls > 0
    calls = model.calls
    assert tune.get_config(buf, "combine", (4096, 7168), "bf16", time_fn=model) == cfg  # now cached
    assert model.calls == calls


def test_autotune_respects_the_buffer_size(tmp_path):
    buf = FakeBuffer()
    buf.num_nvl_bytes = Config(20, 32, 512).get_nvl_buffer_size_hint(7168 * 2, 2)
    seen = []
    model = _model_fn("dispatch")
    res = tune.autotune(buf, "dispatch", (4096, 7168), "bf16", path=str(tmp_path / "t.json"),
                        time_fn=lambda c: seen.append(c) or model(c))
    assert all(c.get_nvl_buffer_size_hint(7168 * 2, 2) <= buf.num_nvl_bytes for c in seen)
    assert res.config.get_nvl_buffer_size_hint(7168 * 2, 2) <= buf.num_nvl_bytes


def test_cli_main_prints_table_and_json(tmp_path, monkeypatch, capsys):
    """main() without spawning: parallel_launch is replaced by canned rank-0 results."""
    def fake_launch(world, worker, args, **kwargs):
        assert worker is tune._cli_worker and world == 2 and kwargs["ranks_per_node"] == 2
        out = []
        for (kind, T), space in tune._cli_spaces(args, world, 2).items():
            res = tune.search(space, bench.SimulatedWorkload(kind, T, args.hidden),
                              default=Config(20, 6, 256, *SINGLE_NODE_RDMA),
                              batches=args.batches)
            out.append({"kind": kind, "num_tokens": T, "dtype": "bf16", **res.to_json()})
        return out

    monkeypatch.setattr(tune, "parallel_launch", fake_launch)
    out_json = tmp_path / "r.json"
    assert tune.main(["--cpu", "--world", "2", "--tokens", "1024", "--sms", "8:24:4", "--no-store",
                      "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "[tuning] Best dispatch: Config(" in text and "[tuning] Best combine: Config(" in text
    assert "median_us" in text and "<- winner" in text
    doc = json.loads(out_json.read_text())
    assert [r["kind"] for r in doc["results"]] == ["dispatch", "combine"]


def test_bench_simulate_smoke(tmp_path, capsys):
    out = tmp_path / "b.json"
    assert bench.main(["--simulate", "--tokens", "4096", "--json", str(out), "--check"]) == 0
    text = capsys.readouterr().out
    assert "exhaustive" in text and "smart" in text and ": ok" in text
    doc = json.loads(out.read_text())
    assert doc["summary"]["ok"] and doc["summary"]["worst_cost_ratio"] <= 0.25
    assert {r["strategy"] for r in doc["rows"]} == {"exhaustive", "smart"}


# ----------------------------------------------------------------------- spawned 2-rank world
class RankBuffer(FakeBuffer):
    def __init__(self, ctx):
        self.group, self.rank, self.num_ranks = ctx.group, ctx.rank, ctx.world_size
        self.topology = Topology(ctx.rank, ctx.world_size, ctx.world_size)


def case_ranks_agree(ctx):
    """Each rank times a different landscape; all must end with the same config, rank 0 stores it."""
    import torch.distributed as dist
    path = os.environ["TUNE_TEST_DIR"] + "/agree.json"
    favourite = 8 if ctx.rank == 0 else 32
    model = bench.SimulatedWorkload("dispatch", 4096, 7168, num_ranks=2, seed=ctx.rank, noise_seed=ctx.rank)

    def time_fn(config):  # rank-dependent: without agreement the ranks would diverge
        return [v * (0.5 if config.num_sms == favourite else 1.0) for v in model(config)]

    res = tune.autotune(RankBuffer(ctx), "dispatch", (1000 + 3000 * ctx.rank, 7168), "bf16", time_fn=time_fn,
                        path=path)
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, (fields_of(res.config), res.num_batches))
    assert everyone[0] == everyone[1], everyone
    dist.barrier()
    # stored once, by rank 0, for the largest token count of any rank (4000 -> bucket 4096)
    (entry,) = json.loads(Path(path).read_text())["entries"].values()
    assert entry["key"]["token_bucket"] == 4096
    assert Config(**entry["config"]) == res.config


def case_cached_config_from_rank0(ctx):
    """Rank 0 decides: rank 1 has no cache file at all, yet gets rank 0's config."""
    path = os.environ["TUNE_TEST_DIR"] + ("/rank0.json" if ctx.rank == 0 else "/rank1-missing.json")
    cfg = Config(24, 16, 512, 64, 1024)
    if ctx.rank == 0:
        tune.store("combine", tune.make_key(2, 2, 7168, "bf16", 4096, "cpu"), cfg, path)
    got = tune.cached_config("combine", 2, 2, 7168, "bf16", 100 if ctx.rank == 0 else 3000, torch.device("cpu"),
                             group=ctx.group, path=path)
    assert got == cfg, got  # both ranks: the bucket of the largest count (3000 -> 4096)
    assert tune.cached_config("dispatch", 2, 2, 7168, "bf16", 100, "cpu", group=ctx.group, path=path) is None
    assert not os.path.exists(os.environ["TUNE_TEST_DIR"] + "/rank1-missing.json")


def case_cli_worker_real_buffer(ctx):
    """The CLI's worker on the real Buffer (reference backend, gloo): tunes both kinds, writes the cache."""
    pytest.importorskip("commlib.buffer")
    path = os.environ["TUNE_TEST_DIR"] + "/cli.json"
    args = tune._parser().parse_args(
        ["--hidden", "256", "--tokens", "32", "--num-experts", "8", "--topk", "2", "--sms", "4,6",
         "--nvl-send", "4,8", "--nvl-recv", "16,32", "--reps", "2", "--warmup", "1", "--batches", "2",
         "--cache", path])
    results = tune._cli_worker(ctx, args)
    if ctx.rank == 0:
        assert [r["kind"] for r in results] == ["dispatch", "combine"]
        for r in results:
            assert r["num_configs"] >= 1 and r["best_time"] > 0
    import torch.distributed as dist
    dist.barrier()
    entries = json.loads(Path(path).read_text())["entries"]
    assert sorted(e["kind"] for e in entries.values()) == ["combine", "dispatch"]


def case_buffer_uses_cached_config(ctx):
    """Buffer.dispatch / combine without a config take the cached one (seen in the handle's channels)."""
    pytest.importorskip("commlib.buffer")
    from commlib.buffer import Buffer
    from commlib.routing import group_limited_topk, random_scores
    path = os.environ["TUNE_TEST_DIR"] + "/buffer.json"
    os.environ["COMMLIB_TUNING_CACHE"] = path
    try:
        T, H, E = 40, 256, 8
        key_ = tune.make_key(ctx.world_size, ctx.world_size, H, "bf16", T, "cpu")
        if ctx.rank == 0:
            tune.store("dispatch", key_, Config(6, 4, 16), path)    # 3 channels, rings of 16 (T = 40 wraps them)
            tune.store("combine", key_, Config(4, 8, 32), path)
        import torch.distributed as dist
        dist.barrier()
        buffer = Buffer(ctx.group, 1 << 24)
        idx, w = group_limited_topk(random_scores(T, E, torch.Generator().manual_seed(ctx.rank)), 4, 2, 2)
        per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, E)
        x = torch.randn(T, H).to(torch.bfloat16)
        recv_x, _, recv_w, _, handle, _ = buffer.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
        assert handle.num_channels == 3, handle.num_channels
        buffer.combine(recv_x, handle, topk_weights=recv_w)
        buffer.destroy()
    finally:
        os.environ.pop("COMMLIB_TUNING_CACHE", None)


WORLD_CASES = ["ranks_agree", "cached_config_from_rank0", "cli_worker_real_buffer", "buffer_uses_cached_config"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tune_world"))
    old = os.environ.get("TUNE_TEST_DIR")
    os.environ["TUNE_TEST_DIR"] = folder  # inherited by the spawned ranks
    try:
        return run_world(2, "test_tune", WORLD_CASES, timeout_s=300)
    finally:
        if old is None:
            os.environ.pop("TUNE_TEST_DIR", None)
        else:
            os.environ["TUNE_TEST_DIR"] = old


@pytest.mark.parametrize("case", WORLD_CASES)
def test_world_case(world, case):
    assert world[case] is None, world[case]
