"""The engine's API contract: handles and their two waits, engine-wide waits, errors reported once and never
lost, close() drains and is idempotent, the context manager, stats."""

import errno
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from nanotron_datastates import DataStatesConfig, DataStatesEngine, _core
from nanotron_datastates.save.handle import wait_handles

from helpers import injected_fault, same, small_config, wait_until


def test_handle_lifecycle_and_stats(engine, tmp_path):
    h = engine.save({"x": torch.randn(1000, 300)}, tmp_path / "x.safetensors")
    h.wait_snapshot()
    assert h.snapshot_done()
    h.wait_persisted()
    assert h.done() and h.exception() is None
    s = h.stats
    assert s["tensor_bytes"] == 1000 * 300 * 4 and s["file_bytes"] == s["tensor_bytes"] + 4096
    assert 0 < s["snapshot_s"] <= s["persisted_s"]
    assert "persisted" in repr(h)


def test_engine_waits_cover_every_save(engine, tmp_path):
    hs = [
        engine.save({"x": torch.full((50_000,), float(i))}, tmp_path / f"{i}.safetensors") for i in range(8)
    ]
    engine.wait_snapshot()
    assert all(h.snapshot_done() for h in hs)
    engine.wait_persisted()
    assert all(h.done() for h in hs)
    for i in range(8):
        assert engine.load(tmp_path / f"{i}.safetensors")["x"][0] == i


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_close_is_idempotent_drains_and_frees_the_cache(tmp_path):
    before = _rss()
    engine = DataStatesEngine(small_config(host_cache_size=0.25))
    engine.prepare_cache()  # otherwise each chunk on its first use
    assert engine.cache_stats()["prepared"] == engine.cache_stats()["chunks"]
    assert _rss() - before > 200 << 20
    hs = [engine.save({"x": torch.randn(1 << 20)}, tmp_path / f"{i}.safetensors") for i in range(4)]
    engine.close()
    assert _rss() - before < 100 << 20
    engine.close()
    assert all(h.done() and h.exception() is None for h in hs)
    with pytest.raises(ValueError, match="closed"):
        engine.save({}, tmp_path / "late.safetensors")
    with pytest.raises(ValueError, match="closed"):
        engine.load(tmp_path / "0.safetensors")


def test_context_manager_closes(tmp_path):
    with DataStatesEngine(small_config()) as e:
        h = e.save({"x": torch.ones(10)}, tmp_path / "c.safetensors")
    assert h.done() and e._closed


def test_timeouts_raise_timeout_error(tmp_path):
    # A 1 MiB cache of 256 KiB chunks and a 64 MiB state: the save cannot finish in a millisecond.
    with DataStatesEngine(DataStatesConfig(host_cache_size=1 / 1024)) as e:
        h = e.save({"x": torch.randn(16 << 20)}, tmp_path / "slow.safetensors")
        with pytest.raises(TimeoutError, match="slow.safetensors"):
            h.wait_persisted(timeout=0.001)
        with pytest.raises(TimeoutError):
            e.wait_persisted(timeout=0.001)
        h.wait_persisted()


def test_an_error_is_raised_by_every_wait_of_its_save_and_once_by_the_engine(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with DataStatesEngine(small_config()) as e:
        h = e.save({"x": torch.ones(4)}, tmp_path / "file" / "x.safetensors")
        with pytest.raises(NotADirectoryError) as err:
            h.wait_snapshot()
        assert err.value.filename == str(tmp_path / "file" / "x.safetensors")
        assert f"creating the directory {tmp_path / 'file'}" in str(err.value)
        with pytest.raises(NotADirectoryError):
            h.wait_persisted()
        assert isinstance(h.exception(), NotADirectoryError)
        e.wait_persisted()  # already reported through the handle

        e.save({"x": torch.ones(4)}, tmp_path / "file" / "y.safetensors")
        with pytest.raises(NotADirectoryError):
            e.wait_persisted()
        e.wait_persisted()  # reported once
        e.save({"x": torch.ones(4)}, tmp_path / "ok.safetensors").wait_persisted()  # still usable


def test_unreported_errors_surface_at_close(tmp_path):
    (tmp_path / "file").write_text("")
    e = DataStatesEngine(small_config())
    e.save({"x": torch.ones(4)}, tmp_path / "file" / "x.safetensors")
    with pytest.raises(NotADirectoryError):
        e.close()


def test_saves_from_several_threads(engine, tmp_path):
    errors = []

    def worker(k):
        try:
            for i in range(5):
                t = torch.full((30_000 + i,), float(k * 10 + i))
                engine.save({"t": t, "k": k}, tmp_path / f"{k}_{i}.safetensors").wait_snapshot()
        except Exception as ex:  # surfaced by the assert below
            errors.append(ex)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    engine.wait_persisted()
    assert not errors
    for k in range(4):
        for i in range(5):
            back = engine.load(tmp_path / f"{k}_{i}.safetensors")
            assert back["k"] == k and same(back["t"], torch.full((30_000 + i,), float(k * 10 + i)))


def test_cache_stats_show_backpressure(tmp_path):
    with DataStatesEngine(DataStatesConfig(host_cache_size=1 / 1024)) as e:
        assert e.cache_stats()["chunks"] == 4
        e.save({"x": torch.randn(4 << 20)}, tmp_path / "s.safetensors").wait_persisted()
        s = e.cache_stats(reset=True)
        assert s["high_water"] == 4 and s["wait_ns"] > 0 and s["in_use"] == 0


def test_saves_prepare_only_the_chunks_in_flight_however_large_the_cache(tmp_path):
    # Pinning holds the CUDA driver's locks (about 0.3 s per GiB): one chunk is ready at start, the others
    # are prepared by their first user, and reused most recent first, so a cache larger than what is in
    # flight is never pinned whole.
    engine = DataStatesEngine(small_config(host_cache_size=0.5, chunk_size=4))
    try:
        assert engine.cache_stats()["prepared"] == 1
        for i in range(3):  # 12 MiB each through 4 MiB chunks of a 512 MiB cache
            engine.save({"x": torch.arange(3 << 20, dtype=torch.float32) + i}, tmp_path / f"{i}.safetensors")
            engine.wait_persisted()
        stats = engine.cache_stats()
        assert stats["prepared"] <= stats["high_water"] + 1 < 128
        for i in range(3):
            got = engine.load(tmp_path / f"{i}.safetensors")["x"]
            assert torch.equal(got, torch.arange(3 << 20, dtype=torch.float32) + i)
    finally:
        engine.close()
    with pytest.raises(ValueError, match="closed"):
        engine.prepare_cache()


def test_a_restore_prepares_only_the_chunks_it_uses(tmp_path):
    with DataStatesEngine(small_config(host_cache_size=0.5, chunk_size=4)) as saver:
        saver.save({"x": torch.randn(1 << 20)}, tmp_path / "a.safetensors")
    with DataStatesEngine(small_config(host_cache_size=0.5, chunk_size=4)) as engine:
        engine.load(tmp_path / "a.safetensors")
        assert engine.cache_stats()["prepared"] < 8
        engine.prepare_cache(nbytes=40 << 20)  # the chunks handed out first, in whole chunks: 10 of 4 MiB
        assert engine.cache_stats()["prepared"] == 10
        engine.prepare_cache(wait=False)  # background
        engine.prepare_cache()  # and this thread: done when it returns
        assert engine.cache_stats()["prepared"] == 128
        with pytest.raises(ValueError, match="nbytes"):
            engine.prepare_cache(nbytes=-1)


def test_the_background_preparation_takes_a_larger_count_after_it_has_finished(tmp_path):
    # The Nanotron saver asks twice: the weights' chunks at start-up, all of a checkpoint's after the first
    # step (the optimizer's state exists from then on), when the first batch is long done.
    with DataStatesEngine(small_config(host_cache_size=0.5, chunk_size=4)) as engine:
        engine.prepare_cache(wait=False, nbytes=8 << 20)
        assert wait_until(lambda: engine.cache_stats()["prepared"] == 2)
        time.sleep(0.05)  # the thread has left its loop
        engine.prepare_cache(wait=False, nbytes=40 << 20)
        assert wait_until(lambda: engine.cache_stats()["prepared"] == 10)
        engine.prepare_cache(wait=False, nbytes=20 << 20)  # smaller: nothing more
        time.sleep(0.05)
        assert engine.cache_stats()["prepared"] == 10
        x = torch.arange(1 << 20, dtype=torch.float32)
        engine.save({"x": x}, tmp_path / "a.safetensors").wait_persisted()
        assert torch.equal(engine.load(tmp_path / "a.safetensors")["x"], x)


def _anon_huge_kib() -> int:
    text = Path("/proc/self/smaps_rollup").read_text()
    return int(next(line.split()[1] for line in text.splitlines() if line.startswith("AnonHugePages:")))


def test_the_cache_is_backed_by_huge_pages_where_the_kernel_grants_them():
    # Faulting in and pinning a cache of many GiB walk its pages: 2 MiB pages make that 512 times fewer.
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("transparent huge pages are off on this machine")
    before = _anon_huge_kib()
    with DataStatesEngine(small_config(host_cache_size=64 / 1024, chunk_size=8)) as engine:
        engine.prepare_cache()
        assert engine.cache_stats()["huge_pages"] is True
        # 64 MiB faulted in: most of it in huge pages (some may be refused under memory fragmentation)
        assert _anon_huge_kib() - before >= 32 << 10
    before = _anon_huge_kib()
    with DataStatesEngine(small_config(host_cache_size=64 / 1024, chunk_size=8, huge_pages=False)) as engine:
        engine.prepare_cache()
        assert engine.cache_stats()["huge_pages"] is False
        if "[always]" not in mode.read_text():  # "always" gives them without the advice
            assert _anon_huge_kib() - before < 32 << 10


def test_a_plan_saved_again_captures_the_values_of_that_time(engine, tmp_path):
    w = torch.zeros(1000, 30)
    plan = engine.plan({"w": w, "step": 7, "nested": [w[:1].clone()]})
    for i in range(3):
        w.fill_(float(i))  # in place, as an optimizer step updates a parameter
        h = engine.save_plan(plan, tmp_path / f"{i}.safetensors")
        h.wait_snapshot()
    engine.wait_persisted()
    for i in range(3):
        state = engine.load(tmp_path / f"{i}.safetensors")
        assert same(state["w"], torch.full((1000, 30), float(i))) and state["step"] == 7
        assert same(state["nested"][0], torch.zeros(1, 30))


def test_an_exact_metadata_plan_writes_the_metadata_verbatim_each_time(engine, tmp_path):
    from safetensors import safe_open

    p = torch.arange(12.0)
    plan = engine.plan({"data": p}, metadata={"sharded": "false"}, exact_metadata=True)
    for i in range(2):
        p.add_(1)
        engine.save_plan(plan, tmp_path / f"{i}.safetensors").wait_persisted()
    for i in range(2):
        with safe_open(str(tmp_path / f"{i}.safetensors"), "pt") as f:
            assert f.metadata() == {"sharded": "false"}
            assert same(f.get_tensor("data"), torch.arange(12.0) + i + 1)


def test_a_plan_is_not_saved_by_a_closed_engine(tmp_path):
    engine = DataStatesEngine(small_config())
    plan = engine.plan({"x": torch.zeros(4)})
    engine.close()
    with pytest.raises(ValueError, match="closed"):
        engine.save_plan(plan, tmp_path / "x.safetensors")


def test_a_staged_save_may_be_mutated_as_soon_as_it_returns(engine, tmp_path):
    w, steps = torch.full((2000, 50), 1.0), torch.tensor(5.0)
    h = engine.save({"w": w, "step": steps}, tmp_path / "s.safetensors", stage=True)
    assert h.staged and h.snapshot_done()
    h.wait_snapshot()  # at once
    w.fill_(2.0)  # no wait for the engine's copies: it reads its own
    steps.add_(1)
    h.wait_persisted()
    back = engine.load(tmp_path / "s.safetensors")
    assert same(back["w"], torch.full((2000, 50), 1.0)) and back["step"].item() == 5.0


def test_a_staged_plan_is_copied_afresh_at_every_save(engine, tmp_path):
    w = torch.zeros(3000)
    plan = engine.plan({"w": w})
    for i in range(3):
        w.fill_(float(i))
        engine.save_plan(plan, tmp_path / f"{i}.safetensors", stage=True)
        w.fill_(-1.0)
    engine.wait_persisted()
    assert [engine.load(tmp_path / f"{i}.safetensors")["w"][0].item() for i in range(3)] == [0.0, 1.0, 2.0]


def test_staged_plans_saved_together_are_packed_as_their_files_and_keep_their_values(engine, tmp_path):
    w = torch.randn(333, 7).to(torch.bfloat16)  # odd sizes: each file's copy still starts aligned
    files = {
        "a": {"w": w, "b": torch.randn(5)},
        "b": {"m": torch.randn(17, 3), "step": torch.tensor(3.0), "t": torch.randn(40)[::2]},  # a view
        "c": {
            "empty": torch.zeros(0, 4),
            "i": torch.arange(9, dtype=torch.int64),
            "u": torch.ones(3, 5).byte(),
        },
    }
    expect = {k: {n: t.clone() for n, t in v.items()} for k, v in files.items()}
    plans = [(engine.plan(state), tmp_path / f"{k}.safetensors") for k, state in files.items()]
    handles = engine.save_plans(plans, stage=True)
    assert [h.path for h in handles] == [str(p) for _, p in plans] and all(h.staged for h in handles)
    storages = set()
    for h in handles:
        staged = [t for t in h._keepalive if t.numel()]
        storages |= {t.untyped_storage().data_ptr() for t in staged}
        # The file's data section order (element size, largest first, stable), back to back.
        at = [t.storage_offset() * t.element_size() for t in sorted(staged, key=lambda t: -t.element_size())]
        ends = [
            a + t.numel() * t.element_size()
            for a, t in zip(at, sorted(staged, key=lambda t: -t.element_size()))
        ]
        assert at[0] % 256 == 0 and at[1:] == ends[:-1], h.path
    assert len(storages) == 1  # one allocation for the whole checkpoint
    for state in files.values():  # the caller may change them at once
        for t in state.values():
            t.fill_(-1) if t.numel() else None
    engine.wait_persisted()
    for k, state in expect.items():
        back = engine.load(tmp_path / f"{k}.safetensors")
        assert back.keys() == state.keys() and all(same(back[n], t) for n, t in state.items()), k


def test_save_plans_without_staging_reads_the_tensors_themselves(engine, tmp_path):
    x = torch.arange(1000.0)
    (h,) = engine.save_plans([(engine.plan({"x": x}), tmp_path / "x.safetensors")])
    assert not h.staged and h._keepalive[0].data_ptr() == x.data_ptr()
    h.wait_snapshot()
    x.zero_()
    h.wait_persisted()
    assert same(engine.load(tmp_path / "x.safetensors")["x"], torch.arange(1000.0))


def test_wait_handles_waits_for_all_at_once_and_leaves_errors_to_each_handle(engine, tmp_path):
    with injected_fault("write", errno.EIO, "bad"):
        hs = [
            engine.save({"x": torch.full((100_000,), float(i))}, tmp_path / f"{n}.safetensors")
            for i, n in enumerate(["a", "bad", "c"])
        ]
        wait_handles(hs)
        assert all(h._job.snapshot_done() for h in hs) and all(h._keepalive is None for h in hs)
        wait_handles(hs, persisted=True)  # the failed one counts as done
    assert all(h.done() for h in hs)
    with pytest.raises(OSError, match="bad"):
        hs[1].wait_persisted()
    hs[0].wait_persisted()
    big = engine.save({"x": torch.randn(50_000_000)}, tmp_path / "big.safetensors")
    with pytest.raises(TimeoutError, match="not all persisted"):
        wait_handles([big], persisted=True, timeout=0)
    engine.wait_persisted()


def test_the_core_refuses_a_staged_view_outside_its_buffer_and_queues_none_of_the_files(engine, tmp_path):
    """The binding's check of staged views (engine.save_plans passes a staged file's tensors as places in
    the staged buffers): a bad one is a ValueError naming the file and the tensor, no file of the call is
    queued, and the engine goes on."""
    base = torch.zeros(64, dtype=torch.uint8)

    def staged(name: str, tensor: str, base: int, offset: int, shape: tuple[int, ...]) -> _core.FileSave:
        view = _core.StagedView(base=base, offset=offset, itemsize=4, shape=shape)
        return _core.FileSave(
            path=str(tmp_path / name),
            names=[tensor],
            dtypes=["F32"],
            views=[view],
            metadata=[],
            embed_checksums=True,
        )

    good, past = staged("a.safetensors", "x", 0, 0, (4,)), staged("b.safetensors", "y", 0, 60, (2,))
    with pytest.raises(ValueError, match=r"tensor 'y' of .*b\.safetensors: its view ends past its buffer"):
        engine._core.save_many([good, past], [base], [])
    absent = staged("c.safetensors", "z", 1, 0, (1,))
    with pytest.raises(ValueError, match="names buffer 1, which is absent"):
        engine._core.save_many([absent], [base], [])
    engine.save({"w": torch.ones(3)}, tmp_path / "d.safetensors").wait_persisted()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.safetensors"]  # a.safetensors never started


def test_staged_nbytes_bounds_the_staged_buffer(engine):
    from nanotron_datastates.save.prepare import prepare_many
    from nanotron_datastates.save.stage import staged_nbytes

    plans = [engine.plan({"a": torch.randn(333, 7), "b": torch.arange(5)}), engine.plan({"c": torch.ones(3)})]
    plans.append(engine.plan({"d": torch.randn(100).to(torch.bfloat16)}))
    (base,) = prepare_many(plans, stage=True)[0].bases
    assert base.numel() <= staged_nbytes(plans) < base.numel() + 256 * len(plans) + 16


def test_at_exit_every_engine_and_handle_lets_go_of_its_core_objects(tmp_path):
    """A script that keeps an engine (closed or not) and its handles in its globals: at exit, before the
    interpreter tears its modules down, the open engine is closed and none keeps a core object (freed later
    than the core's module on some interpreters, the binding reported them as leaks)."""
    script = textwrap.dedent(
        """
        import atexit, sys
        kept = {}
        def check():  # registered first: runs after the package's own exit handler
            done = [kept["open"]._core, kept["closed"]._core, getattr(kept["handle"], "_job", None)]
            print("let go" if done == [None, None, None] and kept["open"]._closed else f"held {done}")
        atexit.register(check)
        import torch
        from nanotron_datastates import DataStatesEngine
        with DataStatesEngine(host_cache_size=1 / 64) as closed:
            closed.save({"x": torch.ones(10)}, sys.argv[1] + "/a.safetensors").wait_persisted()
        kept["closed"] = closed
        kept["open"] = DataStatesEngine(host_cache_size=1 / 64)
        kept["handle"] = kept["open"].save({"x": torch.ones(10)}, sys.argv[1] + "/b.safetensors")
        """
    )
    r = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0 and r.stdout.strip() == "let go", r.stdout + r.stderr
    assert "leaked" not in r.stderr
    assert (tmp_path / "b.safetensors").is_file()  # the save in flight at exit was drained, not dropped
