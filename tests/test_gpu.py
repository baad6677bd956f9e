"""CUDA tensors: device-to-host copies on the engine's stream, ordered after the caller's stream; restore to a
device through pinned chunks. Run on the GPU machine (`pytest -m gpu`); skipped where there is no GPU."""

import concurrent.futures
import time

import pytest
import torch

from nanotron_datastates import DataStatesConfig, DataStatesEngine
from nanotron_datastates import format as fmt

from helpers import constructors_forced_to, random_tensor, same

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture
def gpu_engine():
    with DataStatesEngine(DataStatesConfig(host_cache_size=64 / 1024, chunk_size=4)) as e:
        yield e


def test_cache_is_pinned(gpu_engine):
    assert gpu_engine.pinned


@pytest.mark.parametrize("dtype_name", sorted(fmt.DTYPES))
def test_cuda_round_trip_every_dtype(gpu_engine, tmp_path, dtype_name):
    dtype = fmt.DTYPES[dtype_name].torch
    state = {
        f"s{i}": random_tensor(dtype, s, seed=i).cuda() for i, s in enumerate([(), (0,), (7,), (33, 65)])
    }
    gpu_engine.save(state, tmp_path / "g.safetensors").wait_persisted()
    for device in ("cpu", "cuda"):
        back = gpu_engine.load(tmp_path / "g.safetensors", device)
        for k, v in state.items():
            assert back[k].device.type == device and same(back[k], v), (k, device)


def test_copies_are_ordered_after_the_callers_stream(gpu_engine, tmp_path):
    # Queue a long kernel that writes x, then save x at once: the file must hold the kernel's result.
    x = torch.zeros(16 << 20, device="cuda")
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        a = a @ a / 64
    x.add_(1.0)  # queued after the matmuls on the current stream
    h = gpu_engine.save({"x": x, "v": x[::2]}, tmp_path / "o.safetensors")
    h.wait_snapshot()
    x.add_(1.0)  # after the snapshot: must not reach the file
    h.wait_persisted()
    back = gpu_engine.load(tmp_path / "o.safetensors")
    assert bool((back["x"] == 1.0).all()) and bool((back["v"] == 1.0).all())


def test_a_reused_plan_copies_strided_views_afresh_after_the_callers_stream(gpu_engine, tmp_path):
    x = torch.zeros(4 << 20, device="cuda")
    plan = gpu_engine.plan({"x": x, "v": x[::2]})  # the view needs a contiguous copy at every save
    for i in range(1, 3):
        a = torch.randn(2048, 2048, device="cuda")
        for _ in range(10):
            a = a @ a / 32
        x.fill_(float(i))  # queued after the matmuls on the current stream
        h = gpu_engine.save_plan(plan, tmp_path / f"{i}.safetensors")
        h.wait_snapshot()
        h.wait_persisted()
    for i in range(1, 3):
        back = gpu_engine.load(tmp_path / f"{i}.safetensors")
        assert bool((back["x"] == i).all()) and bool((back["v"] == i).all())


def test_a_staged_save_is_copied_in_the_callers_stream_order(gpu_engine, tmp_path):
    x = torch.zeros(8 << 20, device="cuda")
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        a = a @ a / 64
    x.add_(1.0)  # queued after the matmuls
    h = gpu_engine.save({"x": x, "v": x[::2]}, tmp_path / "s.safetensors", stage=True)
    assert h.staged
    h.wait_snapshot()  # at once
    x.add_(1.0)  # on the same stream, after the device copy: must not reach the file
    h.wait_persisted()
    back = gpu_engine.load(tmp_path / "s.safetensors")
    assert bool((back["x"] == 1.0).all()) and bool((back["v"] == 1.0).all())


def test_staged_plans_saved_together_are_copied_in_the_callers_stream_order(gpu_engine, tmp_path):
    """Twice: the second save stages with the layout the first one made (save/stage.py)."""
    w = torch.zeros(3 << 20, device="cuda", dtype=torch.bfloat16)
    m, cpu = torch.zeros(5 << 20, device="cuda"), torch.zeros(1000)
    plans = [gpu_engine.plan({"w": w, "m": m}), gpu_engine.plan({"m2": m[1:], "cpu": cpu})]
    for r in range(2):
        a = torch.randn(4096, 4096, device="cuda")
        for _ in range(20):
            a = a @ a / 64
        for t in (w, m, cpu):
            t.add_(1)  # the CUDA ones queued after the matmuls
        paths = [tmp_path / str(r) / "a.safetensors", tmp_path / str(r) / "b.safetensors"]
        handles = gpu_engine.save_plans(list(zip(plans, paths)), stage=True)
        staged = [t for h in handles for t in h._keepalive]
        by_device = {t.device.type: t.untyped_storage().data_ptr() for t in staged}
        assert all(t.untyped_storage().data_ptr() == by_device[t.device.type] for t in staged)
        for t in (w, m, cpu):
            t.add_(1)  # after the copies on the same stream: must not reach the files
        gpu_engine.wait_persisted()
        a_back, b_back = (gpu_engine.load(p) for p in paths)
        assert bool((a_back["w"] == 2 * r + 1).all()) and bool((a_back["m"] == 2 * r + 1).all()), r
        assert bool((b_back["m2"] == 2 * r + 1).all()) and bool((b_back["cpu"] == 2 * r + 1).all()), r


def test_views_of_one_buffer_are_copied_right_across_pieces(tmp_path):
    # Views of one buffer, in and out of its order, with a 1 MiB chunk: pieces end inside tensors.
    base = torch.arange(3 << 20, dtype=torch.int32, device="cuda")  # 12 MiB
    cut = [0, 1000, (1 << 20) + 3, 2 << 20, 3 << 20]
    parts = {f"p{i}": base[a:b] for i, (a, b) in enumerate(zip(cut, cut[1:]))}
    states = {"in_order": parts, "reversed": dict(reversed(list(parts.items())))}
    with DataStatesEngine(DataStatesConfig(host_cache_size=8 / 1024, chunk_size=1)) as e:
        for name, state in states.items():
            e.save(state, tmp_path / f"{name}.safetensors").wait_persisted()
            back = e.load(tmp_path / f"{name}.safetensors")
            assert all(same(back[k], v) for k, v in state.items()), name


def test_allocations_back_to_back_in_the_address_space_are_copied_apart(tmp_path):
    # Separate allocations may follow each other in the address space, and a copy over both is refused by
    # the driver ("invalid argument": seen saving 64 unstaged tensors of 32 MiB). Only a staged buffer's
    # tensors may go as one copy.
    torch.cuda.empty_cache()
    ts = [torch.full((8 << 20,), float(i), device="cuda") for i in range(16)]  # 32 MiB: a segment each
    starts = {s["address"] for s in torch.cuda.memory_snapshot()}
    ends = {t.data_ptr() + t.nbytes: t for t in ts}
    pairs = [(ends[t.data_ptr()], t) for t in ts if t.data_ptr() in ends and t.data_ptr() in starts]
    if not pairs:
        pytest.skip("no two allocations back to back on this GPU")
    a, b = pairs[0]
    with DataStatesEngine(DataStatesConfig(host_cache_size=0.5, chunk_size=128)) as e:
        e.save({"a": a, "b": b}, tmp_path / "ab.safetensors").wait_persisted()  # one piece holds both
        back = e.load(tmp_path / "ab.safetensors")
    assert same(back["a"], a) and same(back["b"], b)


def test_staging_out_of_memory_queues_nothing_and_the_engine_goes_on(gpu_engine, tmp_path):
    x = torch.ones(64 << 20, device="cuda")  # 256 MiB
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_allocated() + (128 << 20)) / total)
    try:
        with pytest.raises(torch.cuda.OutOfMemoryError):
            gpu_engine.save_plans([(gpu_engine.plan({"x": x}), tmp_path / "x.safetensors")], stage=True)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert not (tmp_path / "x.safetensors").exists()
    gpu_engine.save_plans([(gpu_engine.plan({"x": x}), tmp_path / "x.safetensors")])[0].wait_persisted()
    assert same(gpu_engine.load(tmp_path / "x.safetensors")["x"], x)


def test_state_larger_than_the_cache_streams_from_the_gpu(tmp_path):
    with DataStatesEngine(DataStatesConfig(host_cache_size=8 / 1024, chunk_size=1)) as e:
        state = {"big": torch.randn(10 << 20, device="cuda"), "small": torch.arange(10, device="cuda")}
        e.save(state, tmp_path / "big.safetensors").wait_persisted()
        back = e.load(tmp_path / "big.safetensors", "cuda")
        assert same(back["big"], state["big"]) and same(back["small"], state["small"])


def test_mixed_cpu_and_cuda_state(gpu_engine, tmp_path):
    state = {"gpu": torch.randn(1000, device="cuda"), "cpu": torch.randn(1000), "step": 3}
    gpu_engine.save(state, tmp_path / "m.safetensors").wait_persisted()
    back = gpu_engine.load(tmp_path / "m.safetensors")
    assert same(back["gpu"], state["gpu"]) and same(back["cpu"], state["cpu"]) and back["step"] == 3


def test_load_into_cuda_tensors_in_place(gpu_engine, tmp_path):
    state = {"w": torch.randn(1000, 300), "e": torch.zeros(0)}
    gpu_engine.save(state, tmp_path / "i.safetensors").wait_persisted()
    dest = {"w": torch.empty(1000, 300, device="cuda"), "e": torch.empty(0, device="cuda")}
    ptr = dest["w"].data_ptr()
    gpu_engine.load_into(tmp_path / "i.safetensors", dest)
    assert dest["w"].data_ptr() == ptr and same(dest["w"], state["w"])


def test_concurrent_restores_to_the_gpu_read_every_byte_while_the_main_thread_works(tmp_path):
    """The shape of a resume (NOTES step 15): small weight files read by four threads at once, then a large
    file, into pinned chunks that earlier reads left full of other bytes, while the main thread allocates,
    frees and launches kernels. Every tensor must pass its checksum and equal what was saved."""

    config = DataStatesConfig(host_cache_size=1, chunk_size=64, parser_threads=4)
    with DataStatesEngine(config) as e:
        small = {
            tmp_path / f"w{i}.safetensors": {"data": random_tensor(torch.bfloat16, (512, 1024), i)}
            for i in range(24)
        }
        moments = [random_tensor(torch.float32, (4 << 20,), i) for i in range(12)]
        big = {"state": {str(i): {"step": torch.tensor(400.0 + i), "m": m} for i, m in enumerate(moments)}}
        sums = {
            path: e.save(state, path, metadata={"k": "v"}, exact_metadata=True).checksums()
            for path, state in small.items()
        }  # kept apart, as the manifest keeps them
        e.save(big, tmp_path / "opt.safetensors")
        e.wait_persisted()
        stop = False

        def busy() -> None:  # stands for the main thread: allocations, frees and kernels
            a = torch.randn(2048, 2048, device="cuda")
            while not stop:
                b = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
                a = a @ a / 2048
                del b

        for _ in range(5):
            with concurrent.futures.ThreadPoolExecutor(1) as side:
                worker = side.submit(busy)
                with concurrent.futures.ThreadPoolExecutor(4) as pool:
                    got = dict(zip(small, pool.map(lambda p: e.load(p, "cuda", checksums=sums[p]), small)))
                back = e.load(tmp_path / "opt.safetensors", "cuda")
                stop = True
                worker.result()
                stop = False
            for path, state in small.items():
                assert same(got[path]["data"].cpu(), state["data"]), path
            for i, s in big["state"].items():
                assert same(back["state"][i]["step"].cpu(), s["step"]) and same(
                    back["state"][i]["m"].cpu(), s["m"]
                )


def test_a_load_on_another_thread_keeps_the_file_dtypes_while_torch_empty_is_patched(gpu_engine, tmp_path):
    """Resume reads ahead while Nanotron builds the model with torch.empty forced to bf16, process-wide: the
    fp32 optimizer state once came back as bf16 tensors and failed its checksums (NOTES step 16)."""
    state = {
        "state": {"0": {"step": torch.tensor(80.0), "exp_avg": random_tensor(torch.float32, (1 << 20,))}}
    }
    gpu_engine.save(state, tmp_path / "opt.safetensors").wait_persisted()
    with constructors_forced_to(torch.bfloat16), concurrent.futures.ThreadPoolExecutor(1) as pool:
        got = pool.submit(gpu_engine.load, tmp_path / "opt.safetensors", "cuda").result()
    for key in ("step", "exp_avg"):
        assert got["state"]["0"][key].dtype == torch.float32
        assert same(got["state"]["0"][key].cpu(), state["state"]["0"][key])


@pytest.mark.parametrize("stage", [False, True])
def test_a_cuda_save_into_its_mirror_and_a_save_recycling_it(gpu_engine, tmp_path, stage):
    """The mirror file as the staging memory of device copies (pinned by blocks laid on the pieces, which
    start after the header), then taken over by the next save: both byte for byte their files."""
    mem = tmp_path / "mem"
    for k, scale in enumerate((1, 2)):
        state = {f"t{i}": torch.randn(3_000_000 + i, device="cuda") * scale for i in range(3)}
        h = gpu_engine.save_plans(
            [(gpu_engine.plan(state), tmp_path / f"{k}.safetensors")],
            stage=stage,
            mirrors=[mem / str(k) / "f.safetensors"],
            recycle=[mem / "0" / "f.safetensors"] if k else None,
        )[0]
        h.wait_persisted()
        assert h.mirrored(), h.mirror_error()
        assert (mem / str(k) / "f.safetensors").read_bytes() == (tmp_path / f"{k}.safetensors").read_bytes()
        back = gpu_engine.load(mem / str(k) / "f.safetensors", "cuda")
        assert all(torch.equal(back[n], v) for n, v in state.items())
    assert not (mem / "0" / "f.safetensors").exists()  # taken over


@pytest.mark.parametrize("first", ["cpu", "cuda"])
def test_a_mirror_of_host_values_is_not_pinned_and_a_gpu_save_never_takes_it_over_as_it_is(
    gpu_engine, tmp_path, first
):
    """A save of host tensors copies into its mirror with memcpy: its mapping is not pinned (pinning takes
    the driver's locks beside training). A save from the GPU recycling that file maps it anew (and pins it);
    a save of host values takes a pinned mapping as it is. Each file byte for byte its storage twin."""
    mem = tmp_path / "mem"
    devices = [first, "cuda" if first == "cpu" else "cpu"]
    for k, device in enumerate(devices):
        state = {f"t{i}": torch.randn(2_000_000 + i, device=device) * (k + 1) for i in range(2)}
        h = gpu_engine.save_plans(
            [(gpu_engine.plan(state), tmp_path / f"{k}.safetensors")],
            mirrors=[mem / str(k) / "f.safetensors"],
            recycle=[mem / "0" / "f.safetensors"] if k else None,
        )[0]
        h.wait_persisted()
        assert h.mirrored(), h.mirror_error()
        if k:  # taken as it is only where the first was pinned (a GPU save's)
            assert h.stats["mirror_kept"] == (first == "cuda")
        assert (mem / str(k) / "f.safetensors").read_bytes() == (tmp_path / f"{k}.safetensors").read_bytes()
        back = gpu_engine.load(mem / str(k) / "f.safetensors", device)
        assert all(torch.equal(back[n], v) for n, v in state.items())


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "read"])
def test_a_file_in_memory_restores_to_the_gpu_through_half_chunks(shm_dir, mapped):
    """The memory tier's read: the file in /dev/shm mapped, each piece copied into one half of a pinned chunk
    while the other half uploads. Several files at once on four threads, from a small cache (chunks taken in
    turns), checksums verified; every byte equal to the saved state."""
    config = DataStatesConfig(
        host_cache_size=32 / 1024, chunk_size=4, parser_threads=4, map_memory_files=mapped
    )
    with DataStatesEngine(config) as e:
        states = {
            shm_dir / f"f{i}.safetensors": {
                f"t{j}": random_tensor(torch.float32, (n,), 10 * i + j).cuda()
                for j, n in enumerate([0, 1, 3 << 20, 513, (1 << 19) + 7])
            }
            for i in range(4)
        }
        for path, state in states.items():
            e.save(state, path)
        e.wait_persisted()
        for _ in range(3):
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                got = dict(zip(states, pool.map(lambda p: e.load(p, "cuda"), states)))
            for path, state in states.items():
                for k, v in state.items():
                    assert got[path][k].is_cuda and same(got[path][k].cpu(), v.cpu()), (path, k)


@pytest.mark.parametrize("copy_mib", [0, 1, 3])
def test_a_chunks_bytes_go_in_copies_of_device_copy_size(tmp_path, copy_mib):
    # 16 MiB chunks of 1 or 3 MiB copies (two in flight, the last one short), or one copy each; a staged
    # save packs many tensors into one run; a tensor that straddles chunks is cut at their edge.
    config = DataStatesConfig(host_cache_size=0.25, chunk_size=16, device_copy_size=copy_mib)
    state = {
        f"t{i}": random_tensor(torch.float32, (n,), seed=i).cuda()
        for i, n in enumerate([5 << 20, 7, 3 << 18])
    }
    with DataStatesEngine(config) as e:
        for stage in (False, True):
            path = tmp_path / f"s{int(stage)}.safetensors"
            e.save_plans([(e.plan(state), path)], stage=stage)[0].wait_persisted()
            back = e.load(path, "cuda")
            assert all(same(back[k], v) for k, v in state.items()), (copy_mib, stage)


def test_copies_of_a_staged_save_go_at_device_copy_gbps_and_others_at_full_speed(tmp_path):
    # 64 MiB at 0.25 GB/s cannot reach the host in less than about 0.27 s (the first 4 MiB piece starts at
    # once); the same bytes unstaged ignore the pace (the caller waits for those). Either way they round-trip.
    state = {"x": random_tensor(torch.float32, (16 << 20,), seed=3).cuda()}
    config = DataStatesConfig(host_cache_size=0.25, chunk_size=16, device_copy_gbps=0.25)
    with DataStatesEngine(config) as e:
        times = {}
        for stage in (True, False):
            path = tmp_path / f"s{int(stage)}.safetensors"
            t0 = time.perf_counter()
            h = e.save_plans([(e.plan(state), path)], stage=stage)[0]
            h.wait_copied()
            times[stage] = time.perf_counter() - t0
            h.wait_persisted()
            assert same(e.load(path, "cuda")["x"], state["x"]), stage
    assert times[True] >= 0.25, times
    assert times[False] < 0.25, times


def test_kept_staging_buffers_still_read_by_a_save_are_never_written(tmp_path):
    """`stage(keep=True)` while the last save still reads its copies (paced: 64 MiB at 0.25 GB/s, about a
    quarter of a second): the new staging takes other memory, kept in place of the first; once that save has
    read them the next staging copies into the kept memory. Every file holds its own staging's values."""
    x = random_tensor(torch.float32, (16 << 20,), seed=4).cuda()
    config = DataStatesConfig(host_cache_size=0.25, chunk_size=16, device_copy_gbps=0.25)
    with DataStatesEngine(config) as e:
        plan = e.plan({"x": x})
        expect, ptrs = [], []
        for n in range(3):
            x.add_(1)
            expect.append(x.clone())
            staged = e.stage([plan], keep=True)
            ptrs.append(staged._prep.bases[0].data_ptr())
            staged.target([tmp_path / f"{n}.safetensors"])
            handle = staged.queue()[0]
            if n == 0:
                assert not handle._job.snapshot_done()  # the second staging finds the first's copies read
            if n == 1:
                handle.wait_copied()
        e.wait_persisted()
        assert ptrs[1] != ptrs[0] and ptrs[2] == ptrs[1], ptrs
        for n, values in enumerate(expect):
            assert same(e.load(tmp_path / f"{n}.safetensors", "cuda")["x"], values), n


def test_a_checkpoint_that_fits_the_staging_memory_kept_is_staged_without_asking_the_allocator(monkeypatch):
    from nanotron_datastates.save import staging

    def asked(*a, **k):
        raise AssertionError("the allocator was asked")

    monkeypatch.setattr(torch.cuda, "mem_get_info", asked)
    stage, why = staging.decide("auto", 1 << 20, held=2 << 20)
    assert stage and "kept" in why
    with pytest.raises(AssertionError, match="allocator was asked"):
        staging.decide("auto", 3 << 20, held=2 << 20)
