"""Readers of the per-layer profiles, model sizes, link fits and GPU specs."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest

from pipedejavu.core.problem import ProblemError
from pipedejavu.costmodel.megatron.sailor_data import (
    BandwidthFit,
    LayerTimes,
    SailorData,
    bundled_sailor_dir,
    smooth_profile,
)

DATA = SailorData()
PROFILES = [(m, g) for m in DATA.models() for g in DATA.gpu_types(m)]


@pytest.mark.parametrize("model, gpu", PROFILES, ids=lambda x: str(x))
def test_every_profile_reads(model, gpu):
    table = DATA.profile(model, gpu)
    info = DATA.model_info(model)
    assert table
    for (mbs, tp), entry in table.items():
        assert mbs >= 1 and tp >= 1
        assert entry.forward.shape == (info.num_layers,)
        assert (entry.forward > 0).all() and (entry.backward >= 0).all()
        assert np.ptp(entry.update) == 0  # one optimizer time, repeated
    smoothed = smooth_profile(table)
    assert smoothed.keys() == table.keys()


def test_model_info_opt350():
    info = DATA.model_info("OPT-350")
    assert info.num_layers == 26 and info.tp_values == (1, 2, 4, 8)
    params = info.params[1]
    # word (50304 x 1024) + position (2048 x 1024) embeddings; the head ties the
    # word embedding and adds the final norm (2 x 1024).
    assert params[0] == 50304 * 1024 + 2048 * 1024
    assert params[25] == 50304 * 1024 + 2 * 1024
    assert info.tied_params(1) == params[25]
    # One transformer layer: 12 h^2 + 13 h parameters.
    assert params[1] == 12 * 1024**2 + 13 * 1024
    assert info.act_output[4][11] == 2048 * 1024  # seq x hidden


def test_gpu_specs_and_errors():
    spec = DATA.gpu_spec("GH-96")
    assert (spec.gpus_per_node, spec.memory_bytes) == (4, 102625181696)
    assert DATA.gpu_spec("RTX-3090").gpus_per_node == 8
    with pytest.raises(ProblemError, match="unknown GPU type 'H200'"):
        DATA.gpu_spec("H200")
    with pytest.raises(ProblemError, match="no profile of model OPT-350 on GPU"):
        DATA.profile("OPT-350", "H200")
    with pytest.raises(ProblemError, match="no profiles for model 'GPT-5'"):
        DATA.gpu_types("GPT-5")
    with pytest.raises(ProblemError, match=r"no entry for mbs 3, tp 4 \(it has"):
        DATA.layer_times("OPT-350", "GH-96", 3, 4)
    with pytest.raises(ProblemError, match="no sizes for tp 3"):
        DATA.model_info("OPT-350").check_tp(3)


def test_bandwidth_fit():
    fit = BandwidthFit((-0.16570216, 2.79431173, 11.74409677), 22934533176.5)
    # The README's example: about 11.7 GB/s at 1 MB, capped at about 23 GB/s.
    assert fit.bandwidth(1e6) == pytest.approx(11.744e9, rel=1e-3)
    assert fit.bandwidth(1e9) == pytest.approx(22934533176.5)
    # Below 1 MB the 1 MB bandwidth holds; time is linear in bytes there.
    assert fit.bandwidth(1e3) == fit.bandwidth(1e6)
    assert fit.time(5e5) == pytest.approx(5e5 / fit.bandwidth(1e6))
    times = [fit.time(b) for b in np.geomspace(1e3, 1e11, 50)]
    assert all(a <= b for a, b in zip(times, times[1:], strict=False))
    assert fit.time(0) == 0.0


def test_network_lookup():
    net = DATA.network
    one = net.inter("us-central1-a", "GH-96", "us-central1-a", "GH-96", 1)
    four = net.inter("us-central1-a", "GH-96", "us-central1-a", "GH-96", 4)
    assert four.bandwidth(1e6) == pytest.approx(45.25e9, rel=1e-3)
    assert four.bandwidth(1e8) > 3 * one.bandwidth(1e8)
    # 3 GPUs round up to the 4-GPU fit; 16 down to the largest.
    assert net.inter("us-central1-a", "GH-96", "us-central1-a", "GH-96", 3) == four
    assert net.inter("us-central1-a", "GH-96", "us-central1-a", "GH-96", 16) == four
    slow = net.inter("us-central1-a", "RTX-3090", "us-central1-a", "Titan-RTX", 8)
    assert slow.bandwidth(1e8) == pytest.approx(0.114e9, rel=0.05)
    # A100-80 is only in the homogeneous fallback table.
    assert net.inter("us-central1-a", "A100-80", "us-central1-a", "A100-80", 4)
    assert net.intra("GH-96", 4).bandwidth(1e6) == pytest.approx(82.06e9, rel=1e-3)
    with pytest.raises(ProblemError, match="no link fit between GH-96"):
        net.inter("us-central1-a", "GH-96", "us-central1-a", "RTX-3090", 1)


def test_smooth_profile_is_affine_and_keeps_affine_data():
    mbs = [1, 2, 4, 8, 16]
    layers = 3

    def entry(m, noise=1.0):
        forward = np.array([0.5 + 0.25 * m, 1.0 * m, 2.0]) * 1e-3
        forward[1] *= noise
        return LayerTimes(forward, 2 * forward, np.full(layers, 1e-3 * m))

    exact = {(m, 1): entry(m) for m in mbs}
    smoothed = smooth_profile(exact)
    for m in mbs:
        np.testing.assert_allclose(smoothed[(m, 1)].forward, exact[(m, 1)].forward)
        np.testing.assert_allclose(smoothed[(m, 1)].backward, exact[(m, 1)].backward)
        assert smoothed[(m, 1)].update[0] == pytest.approx(4e-3)  # median over mbs
    # One noisy small-mbs entry (like GH-96 at tp 4, mbs 1) is pulled to the line.
    noisy = dict(exact)
    noisy[(1, 1)] = entry(1, noise=1.6)
    fixed = smooth_profile(noisy)[(1, 1)].forward[1]
    assert 1e-3 < fixed < 1.5e-3  # toward the line (1e-3) from 1.6e-3
    # Fewer than three mbs values: the entries stay.
    two = {(1, 2): entry(1, noise=3.0), (2, 2): entry(2)}
    np.testing.assert_array_equal(
        smooth_profile(two)[(1, 2)].forward, two[(1, 2)].forward
    )


def _copy(tmp_path):
    root = tmp_path / "data"
    shutil.copytree(bundled_sailor_dir(), root)
    return root


def test_bad_files_name_the_file(tmp_path):
    root = _copy(tmp_path)
    profile = root / "profiles" / "OPT-350" / "GH-96" / "profile.json"
    data = json.loads(profile.read_text())
    data["1"]["4"]["3"] = [1.0, "x", 0.0]
    profile.write_text(json.dumps(data))
    with pytest.raises(ProblemError, match=r"profile.json: mbs 1 tp 4 .* number"):
        SailorData(root).profile("OPT-350", "GH-96")
    data["1"]["4"]["3"] = [1.0, math.inf, 0.0]
    profile.write_text(json.dumps(data).replace("Infinity", "1e999"))
    with pytest.raises(ProblemError, match="finite"):
        SailorData(root).profile("OPT-350", "GH-96")
    (root / "llm_info.json").write_text("[1, 2")
    with pytest.raises(ProblemError, match="llm_info.json: invalid JSON"):
        SailorData(root).model_info("OPT-350")
    with pytest.raises(ProblemError, match="does not exist"):
        SailorData(tmp_path / "nowhere")
