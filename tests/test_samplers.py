"""The sampler seam: chosen at create, recorded in the metadata, restored at open."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mmreplay as mr
from mmreplay.read.draws import draw_uniform
from mmreplay.samplers import Sampler, SliceSampler, UniformSampler, register_sampler

SPEC = {"x": mr.ArraySpec((), "int64"), "terminated": mr.ArraySpec((), "bool")}


def fill(store, n):
    store.extend({"x": np.arange(n)[:, None], "terminated": (np.arange(n) % 5 == 4)[:, None]})
    store.commit()


@register_sampler
class Newest(Sampler):
    """Uniform over the newest ``last`` steps (a sampler a user would write)."""

    name = "test-newest"

    def __init__(self, last: int = 3):
        self.last = last

    def state_json(self):
        return {"name": self.name, "last": self.last}

    options = frozenset({"last"})  # sample(..., last=k) overrides it for one call

    def draw(self, window, request, size, steps, rng):
        last = request.options.get("last", self.last)
        recent = window._replace(first=max(window.first, window.end - last))
        return draw_uniform(recent, size, steps, request.replacement, rng)


def test_default_is_uniform_and_leaves_the_metadata_as_before(tmp_path):
    with mr.create(tmp_path / "b", SPEC, 20) as store:
        assert isinstance(store.sampler, UniformSampler)
    assert "sampler" not in json.loads((tmp_path / "b" / "mmreplay.json").read_text())


def test_slices_sampler_is_recorded_and_restored(tmp_path):
    with mr.create(tmp_path / "b", SPEC, 20, sampler="slices", num_steps=3) as store:
        fill(store, 15)
        x = store.sample(200, rng=0)["x"]
        assert x.shape == (200, 3) and ((x[:, 2] - x[:, 0]) == 2).all()
        assert not np.isin(x[:, :2] % 5, [4]).any()  # never crosses an episode end
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(f"""
            import mmreplay as mr
            with mr.open({str(tmp_path / "b")!r}) as r:
                print(type(r.sampler).__name__, r.sampler.num_steps, r.sample(4, rng=0)["x"].shape)
        """)],
        capture_output=True, text=True, timeout=120,
    )
    assert out.stdout.split() == ["SliceSampler", "3", "(4,", "3)"], out.stderr
    with mr.open(tmp_path / "b") as r:
        assert r.sample(5, num_steps=2, within_episodes=False, rng=0)["x"].shape == (5, 2)


def test_a_user_sampler_draws_through_the_store_and_is_restored(tmp_path):
    with mr.create(tmp_path / "b", SPEC, 20, sampler="test-newest", last=2) as store:
        fill(store, 10)
        assert set(store.sample(100, rng=0)["x"].tolist()) == {8, 9}
    with mr.open(tmp_path / "b") as r:
        assert isinstance(r.sampler, Newest) and r.sampler.last == 2
        _, info = r.sample(10, rng=0, return_info=True)
        assert set(info.step.tolist()) <= {8, 9} and np.allclose(info.probability, 0.5)


def test_a_sampler_reads_the_options_it_names_and_others_are_refused_before_a_draw(tmp_path):
    with mr.create(tmp_path / "b", SPEC, 20, sampler="test-newest", last=3) as store:
        fill(store, 10)
        assert set(store.sample(50, rng=0, last=1)["x"].tolist()) == {9}
        rng = np.random.default_rng(0)
        with pytest.raises(TypeError, match=r"b: the 'test-newest' sampler takes no option 'beta' \(its options: 'last'\)"):
            store.sample(5, rng=rng, beta=0.4)
        assert rng.bit_generator.state == np.random.default_rng(0).bit_generator.state  # nothing drawn
    with mr.create(tmp_path / "u", SPEC, 20) as store:
        fill(store, 10)
        with pytest.raises(TypeError, match="the 'uniform' sampler takes no option 'beta' \\(its options: none\\)"):
            store.sample(5, beta=0.4)


def test_an_instance_is_used_as_given(tmp_path):
    sampler = SliceSampler(num_steps=2, within_episodes=False)
    with mr.create(tmp_path / "b", SPEC, 20, sampler=sampler) as store:
        assert store.sampler is sampler
        with pytest.raises(TypeError, match="instance"):
            mr.create(tmp_path / "c", SPEC, 20, sampler=sampler, num_steps=3)


def test_an_unknown_sampler_is_named(tmp_path):
    with pytest.raises(ValueError, match="unknown sampler 'nope'"):
        mr.create(tmp_path / "b", SPEC, 20, sampler="nope")
    assert not (tmp_path / "b").exists()
    with pytest.raises(TypeError, match="keeps no priorities"):
        with mr.create(tmp_path / "c", SPEC, 20) as store:
            fill(store, 3)
            store.update_priorities([0], [0], [1.0])
