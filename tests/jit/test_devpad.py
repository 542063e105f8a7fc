"""Device arrays padded (and outputs cut) on the device once their shape has paid for it
(``jit/_devpad.py``).  The tests set the price of a program, so that the rule, the programs
and their results run in a few calls."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynjax
from dynjax._config import config
from dynjax.jit import _devpad


@pytest.fixture
def priced(monkeypatch):
  """The device route at a price set by the test (``price[0]`` seconds)."""
  price = [0.0]
  monkeypatch.setattr(_devpad, "price", lambda: price[0])
  return price


def step(x, lengths, w):
  """A masked encoder-ish step: a result with the request's dims and a loss without."""
  h = jnp.tanh(x @ w)
  mask = jnp.arange(x.shape[1])[None, :] < lengths[:, None]
  loss = jnp.sum(jnp.where(mask[..., None], h, 0.0) ** 2)
  return h, loss


DIMS = {"x": "b, t, 8", "lengths": "b", "w": None}


def _request(rng, b, t):
  x = jnp.asarray(rng.normal(size=(b, t, 8)), jnp.float32)
  lengths = jnp.asarray(rng.integers(1, t + 1, size=b), jnp.int32)
  return x, lengths


@pytest.mark.parametrize("padding", ["auto", "trust"])
def test_device_requests_pad_and_cut_on_the_device_and_match_jax_jit(priced, padding, compiles):
  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.normal(size=(8, 8)), jnp.float32)
  f = dynjax.jit(step, dims=DIMS, padding=padding)
  ref = jax.jit(step)
  shapes = [(3, 5), (3, 5), (2, 7), (3, 5), (2, 7)]
  for b, t in shapes:
    x, lengths = _request(rng, b, t)
    h, loss = f(x, lengths, w)
    want_h, want_loss = ref(x, lengths, w)
    assert isinstance(h, jax.Array) and h.shape == (b, t, 8)
    np.testing.assert_array_equal(np.asarray(h), np.asarray(want_h))
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
  d = f.stats()["device_pads"]
  # (3, 5) -> (4, 8) and (2, 7) -> (2, 8): x and lengths padded (lengths (3,) -> (4,) only in
  # the first), h cut back: 5 sites, each bought at its first trip (price 0).
  assert d["sites"] == 5 and d["programs"] == 5 and d["host_trips"] == 5
  # Bought: the same shapes again run no host trip and compile nothing.
  before = compiles()
  for b, t in ((3, 5), (2, 7)):
    x, lengths = _request(rng, b, t)
    h, _ = f(x, lengths, w)
    np.testing.assert_array_equal(np.asarray(h), np.asarray(ref(x, lengths, w)[0]))
  assert f.stats()["device_pads"]["host_trips"] == 5
  assert compiles() == before  # (jax.jit has these shapes too)


def test_the_host_route_until_the_trips_add_up_to_the_price(priced):
  rng = np.random.default_rng(1)
  w = jnp.ones((8, 8), jnp.float32)
  f = dynjax.jit(step, dims=DIMS)
  x, lengths = _request(rng, 3, 5)
  priced[0] = 1e9  # never paid
  for _ in range(4):
    f(x, lengths, w)
  d = f.stats()["device_pads"]
  assert d["programs"] == 0 and d["host_trips"] == 4 * 3 and d["host_trip_seconds"] > 0
  priced[0] = 0.0
  f(x, lengths, w)
  assert f.stats()["device_pads"]["programs"] == 3
  # One site: trips below the price rent, the one that reaches it buys.
  priced[0] = 1.0
  site = _devpad.Sites().site("pad", (3, 5), (4, 8), np.float32, jax.devices()[0])
  site.rent(0.6)
  assert site.fn is None and site.owner.programs == 0
  site.rent(0.4)
  assert site.fn is not None and site.owner.programs == 1 and site.owner.trips == 2
  out = site.run(jnp.ones((3, 5), jnp.float32), None)
  np.testing.assert_array_equal(np.asarray(out), np.pad(np.ones((3, 5)), ((0, 1), (0, 3))))


def test_numpy_requests_padded_requests_and_return_padded_keep_their_routes(priced):
  rng = np.random.default_rng(2)
  w = jnp.ones((8, 8), jnp.float32)
  x, lengths = _request(rng, 3, 5)
  f = dynjax.jit(step, dims=DIMS)
  h, _ = f(np.asarray(x), np.asarray(lengths), w)  # a host request: numpy out, no site
  assert type(h) is np.ndarray
  assert f.stats()["device_pads"]["sites"] == 0
  g = dynjax.jit(step, dims=DIMS, return_padded=True)
  hp, _ = g(x, lengths, w)  # inputs padded on the device; the output stays padded: no cut
  assert isinstance(hp, dynjax.Padded) and hp.shape == (3, 5, 8)
  assert g.stats()["device_pads"]["sites"] == 2
  h2, _ = g(hp, lengths, w)  # a Padded of the bucket's shape goes in as it is
  np.testing.assert_array_equal(np.asarray(h2.unpad()), np.asarray(
      jax.jit(step)(jnp.asarray(hp.unpad()), lengths, w)[0]))


def test_off_with_the_environment_switch_and_off_the_platforms(priced, monkeypatch):
  rng = np.random.default_rng(3)
  w = jnp.ones((8, 8), jnp.float32)
  x, lengths = _request(rng, 3, 5)
  monkeypatch.setattr(config, "device_pad", False)  # DYNJAX_DEVICE_PAD=0
  f = dynjax.jit(step, dims=DIMS)
  f(x, lengths, w)
  assert f.stats()["device_pads"]["sites"] == 0
  monkeypatch.setattr(config, "device_pad", True)
  monkeypatch.setattr(_devpad, "PLATFORMS", ())
  g = dynjax.jit(step, dims=DIMS)
  g(x, lengths, w)
  assert g.stats()["device_pads"]["sites"] == 0


def test_a_program_that_fails_to_build_leaves_the_host_route(priced, monkeypatch):
  def broken(*_, **__):
    raise RuntimeError("no pad today")

  monkeypatch.setattr(_devpad, "lax", types.SimpleNamespace(pad=broken, slice=broken))
  rng = np.random.default_rng(4)
  w = jnp.ones((8, 8), jnp.float32)
  f = dynjax.jit(step, dims=DIMS)
  for _ in range(3):
    x, lengths = _request(rng, 3, 5)
    h, _ = f(x, lengths, w)
    np.testing.assert_array_equal(np.asarray(h), np.asarray(jax.jit(step)(x, lengths, w)[0]))
  d = f.stats()["device_pads"]
  assert d["programs"] == 0 and d["host_trips"] == 3 * 3  # tried once a site, then never again


def test_price_is_the_measured_median_once_a_program_is_built(monkeypatch):
  monkeypatch.setattr(_devpad, "_compiled", [])
  assert _devpad.price() == _devpad.PRIOR_S
  monkeypatch.setattr(_devpad, "_compiled", [0.36, 0.08, 0.06])  # a first compile's extra
  assert _devpad.price() == pytest.approx(0.08)


def test_stats_of_several_functions_add_their_device_pads_seconds_too():
  from dynjax.jit import _stats

  one = {"calls": 2, "padded_fraction": 0.5,
         "device_pads": {"programs": 1, "compile_seconds": 0.25, "host_trip_seconds": 0.5}}
  two = {"calls": 2, "padded_fraction": 0.0,
         "device_pads": {"programs": 2, "compile_seconds": 0.5, "host_trip_seconds": 0.25}}
  total = _stats.combine([one, two])
  assert total["device_pads"] == {"programs": 3, "compile_seconds": 0.75,
                                  "host_trip_seconds": 0.75}
  assert total["calls"] == 4 and total["padded_fraction"] == 0.25


def test_threads_racing_one_site_buy_one_program_and_get_right_results(priced):
  import concurrent.futures

  rng = np.random.default_rng(5)
  w = jnp.asarray(rng.normal(size=(8, 8)), jnp.float32)
  f = dynjax.jit(step, dims=DIMS)
  ref = jax.jit(step)
  reqs = [_request(rng, 3, 5) for _ in range(24)]
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    outs = list(pool.map(lambda r: f(*r, w)[0], reqs))
  for (x, lengths), h in zip(reqs, outs, strict=True):
    np.testing.assert_array_equal(np.asarray(h), np.asarray(ref(x, lengths, w)[0]))
  d = f.stats()["device_pads"]
  assert d["sites"] == d["programs"] == 3  # x, lengths, h: one buyer each
