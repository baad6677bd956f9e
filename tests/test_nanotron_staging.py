"""When the trainer copies a checkpoint on the GPU first (`device_snapshot`): room above the peak, with a
spare of the larger of 1 GiB and 5% of the GPU."""

import torch

from nanotron_datastates.save import staging

GIB = 1 << 30


def test_it_fits_only_above_the_peak_with_room_to_spare():
    total = 80 * GIB  # spare: 4 GiB
    assert staging.fits(10 * GIB, free=40 * GIB, reserved=30 * GIB, peak=50 * GIB, total=total)
    assert staging.fits(16 * GIB, free=40 * GIB, reserved=30 * GIB, peak=50 * GIB, total=total)
    assert not staging.fits(17 * GIB, free=40 * GIB, reserved=30 * GIB, peak=50 * GIB, total=total)
    # Another process holding memory: only what is free to this one counts.
    assert not staging.fits(10 * GIB, free=5 * GIB, reserved=30 * GIB, peak=28 * GIB, total=total)
    assert staging.spare_bytes(8 * GIB) == GIB


def test_never_and_auto_without_a_gpu_do_not_stage_always_does():
    assert staging.decide("never", 1) == (False, "device_snapshot: never")
    assert staging.decide("always", 1) == (True, "device_snapshot: always")  # without a GPU: in host memory
    if not torch.cuda.is_available():
        assert staging.decide("auto", 1) == (False, "no GPU")
    else:
        assert staging.decide("auto", 1)[0]
        assert not staging.decide("auto", 1 << 50)[0]
