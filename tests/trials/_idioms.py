"""Public-code idioms over a dynamic axis (session 22): one-liners as NumPy/JAX code writes
them (signal processing, statistics, sorting, pooling, masks, loops, random draws, scatter),
each a function of ``x`` of shape ``(t, 4)`` (or ``(t,)``), run by ``test_idioms.py`` under
``padding="auto"`` against ``jax.jit`` at each exact shape.  ``FALLS_BACK``: the ones dynjax
runs unpadded today, each with the cause."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# name -> why it runs exact per shape (the fallback's reason contains the key's value)
FALLS_BACK = {
  "lstsq": "svd",  # pinv's SVD: no exact rule (singular vectors' signs)
  "array_split_time": "unsupported operand",  # array_split's sizes by Python arithmetic
  "choice_of_n": "requires a constant",  # choice(key, n): int(n); choice(key, jnp.arange(n)) works
}

IDIOMS = {}
def idiom(dims, shapes):
  def deco(f):
    IDIOMS[f.__name__] = (f, dims, shapes)
    return f
  return deco

# x: (t, d) sequences, d=4 unless noted
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def stride2(x): return x[::2] * 2
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def odd_stride(x): return x[1::2] - x[::2][: (x.shape[0]) // 2]
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def diff(x): return jnp.diff(x, axis=0)
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def gradient(x): return jnp.gradient(x, axis=0)
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def trapezoid(x): return jnp.trapezoid(x, axis=0)
@idiom({"x": "t"}, lambda t: [(t,)])
def convolve_full(x): return jnp.convolve(x, jnp.array([1., 2., 3.]))
@idiom({"x": "t"}, lambda t: [(t,)])
def convolve_same(x): return jnp.convolve(x, jnp.array([1., 2., 3.]), mode="same")
@idiom({"x": "t"}, lambda t: [(t,)])
def correlate_valid(x): return jnp.correlate(x, jnp.array([1., -1.]), mode="valid")
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def cov(x): return jnp.cov(x, rowvar=False)
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def corrcoef(x): return jnp.corrcoef(x, rowvar=False)
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def norm_time(x): return jnp.linalg.norm(x, axis=0)
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def quantile(x): return jnp.quantile(x, jnp.array([0.1, 0.5, 0.9]), axis=0)
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def nanmean(x): return jnp.nanmean(jnp.where(x > 1.5, jnp.nan, x), axis=0)
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def argsort_time(x): return jnp.argsort(x[:, 0])
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def sort_rows(x): return jnp.sort(x, axis=0)
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def lexsort(x): return jnp.lexsort((x[:, 1], jnp.round(x[:, 0])))
# sorts whose keys hold the value their order puts last (session 23's sort rule fills the
# padding with it): NaN, True, an int8's 127
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def nanmedian(x): return jnp.nanmedian(jnp.where(x > 1.0, jnp.nan, x), axis=0)
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def argsort_nan_desc(x):
  return jnp.argsort(jnp.where(x[:, 0] > 1.0, jnp.nan, x[:, 0]), descending=True, stable=True)
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def sort_bool(x): return jnp.sort(x[:, 0] > 0)
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def sort_int8_saturated(x): return jnp.sort(jnp.clip(x[:, 0] * 200, -128, 127).astype(jnp.int8))
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def sort_complex(x): return jnp.sort_complex(jnp.where(x[:, 0] > 1.0, jnp.nan, x[:, 0])
                                             + 1j * x[:, 1])
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def partition(x): return jnp.partition(x, 2, axis=0)[:3]
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def top_p_mass(x): return jnp.cumsum(jnp.sort(jax.nn.softmax(x[:, 0]))[::-1])
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def topk_time(x): return lax.top_k(x[:, 0], 3)
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def cumlogsumexp(x): return lax.cumlogsumexp(x, axis=0)
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def logsumexp(x): return jax.scipy.special.logsumexp(x, axis=0)
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def tril_mask(x): return jnp.tril(x @ x.T) @ x
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def alibi(x):
  t = x.shape[0]
  pos = jnp.arange(t)
  bias = -jnp.abs(pos[:, None] - pos[None, :]) * 0.5
  return jax.nn.softmax(x @ x.T + bias, axis=-1) @ x
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def one_hot_pos(x): return jax.nn.one_hot(jnp.arange(x.shape[0]) % 3, 3).T @ x
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def outer(x): return jnp.outer(x[:, 0], x[:, 1]).sum(0)
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def meshgrid(x):
  a, b = jnp.meshgrid(x[:, 0], x[:, 1], indexing="ij")
  return (a * b).sum(1)
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def pad_reflect(x): return jnp.pad(x, ((2, 2), (0, 0)), mode="reflect")
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def pad_edge(x): return jnp.pad(x, ((2, 2), (0, 0)), mode="edge")
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def pad_wrap(x): return jnp.pad(x, ((2, 2), (0, 0)), mode="wrap")
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def roll_data(x): return jnp.roll(x, jnp.int32(jnp.sum(x > 0)), axis=0)
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def flip_cumsum(x): return jnp.flip(jnp.cumsum(jnp.flip(x, 0), 0), 0)
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def where_size(x): return jnp.where(x[:, 0] > 0, size=5, fill_value=-1)[0]
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def nonzero_size(x): return jnp.nonzero(x[:, 0] > 0, size=4)[0]
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def unique_size(x): return jnp.unique(jnp.round(x[:, 0]), size=6, fill_value=99.0)
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def repeat_total(x): return jnp.repeat(x[:, 0], 2, total_repeat_length=2 * x.shape[0])
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def repeat_plain(x): return jnp.repeat(x, 2, axis=0)
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def tile(x): return jnp.tile(x, (2, 1))
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def stack_shift(x): return jnp.stack([x[:-1], x[1:]], axis=-1)
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def reduce_window_max(x): return lax.reduce_window(x, -jnp.inf, lax.max, (3, 1), (2, 1), "SAME")
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def avg_pool_valid(x):
  import flax.linen as nn
  return nn.avg_pool(x[None], (2,), strides=(2,), padding="VALID")[0]
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def conv_strided(x):
  k = jnp.ones((3, 4, 2)) * 0.1
  return lax.conv_general_dilated(x[None], k, (2,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"))[0]
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def conv_dilated(x):
  k = jnp.ones((3, 4, 2)) * 0.1
  return lax.conv_general_dilated(x[None], k, (1,), "VALID", rhs_dilation=(2,), dimension_numbers=("NWC", "WIO", "NWC"))[0]
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def image_resize(x): return jax.image.resize(x, (16, 4), "linear")
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def random_perm(x): return jax.random.permutation(jax.random.key(0), x, axis=0)
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def random_choice(x): return jax.random.choice(jax.random.key(1), x, (3,), replace=False)
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def dropout_like(x): return jnp.where(jax.random.bernoulli(jax.random.key(2), 0.7, x.shape), x / 0.7, 0)
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def cholesky_gram(x): return jnp.linalg.cholesky(x.T @ x + jnp.eye(4))
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def lstsq(x): return jnp.linalg.pinv(x) @ jnp.ones((x.shape[0],))
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def einsum_att(x): return jnp.einsum("td,sd->ts", x, x).max(1)
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def split_halves(x):
  a, b = jnp.split(x, 2, axis=1)
  return a * b
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def array_split_time(x):
  return jnp.array_split(x, 3, axis=0)[0]
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def segment_by_cumsum(x):
  ids = jnp.cumsum(x[:, 0] > 1.0)
  return jax.ops.segment_sum(x, ids, num_segments=8)
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def argmax_time(x): return jnp.argmax(x, axis=0), jnp.argmin(x, axis=0)
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def median(x): return jnp.median(x, axis=0)
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def histogram(x): return jnp.histogram(x[:, 0], bins=5, range=(-2, 2))[0]
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def histogram_auto(x): return jnp.histogram(x[:, 0], bins=5)[0]
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def ema_scan(x):
  def step(h, xt):
    h = 0.9 * h + 0.1 * xt
    return h, h
  return lax.scan(step, jnp.zeros(4), x)[1]
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def fori_over_len(x):
  return lax.fori_loop(0, x.shape[0], lambda i, c: c + x[i], jnp.zeros(4))
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def while_argmax(x):
  def cond(s): return (s[0] < x.shape[0]) & (x[s[0], 0] < 1.0)
  return lax.while_loop(cond, lambda s: (s[0] + 1, s[1] + x[s[0]]), (0, jnp.zeros(4)))
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def dynamic_slice_last(x): return lax.dynamic_slice_in_dim(x, x.shape[0] - 2, 2, axis=0)
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def take_last(x): return x[-1], x[-3:]
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def vmap_pairwise(x): return jax.vmap(lambda a: jnp.min(jnp.sum((x - a) ** 2, -1)))(x)
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def knn(x):
  d = jnp.sum((x[:, None] - x[None]) ** 2, -1)
  return lax.top_k(-d, 2)[1]
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def softmax_where(x):
  return jax.nn.softmax(x, axis=0, where=x > 0)
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def log_softmax_time(x): return jax.nn.log_softmax(x, axis=0)
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def std_var(x): return jnp.std(x, axis=0, ddof=1), jnp.var(x, axis=0)
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def count_nonzero(x): return jnp.count_nonzero(x > 0, axis=0)
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def all_any(x): return jnp.all(x > -3, axis=0), jnp.any(x > 2, axis=0)
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def polyval(x): return jnp.polyval(x[:, 0], 0.5)
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def vander(x): return jnp.vander(x[:, 0], 3)
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def kron(x): return jnp.kron(x[:, :2], jnp.eye(2))
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def triu_indices(x):
  i, j = jnp.triu_indices(4)
  return x[:, i] * x[:, j]
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def cumprod_reverse(x): return jnp.cumprod(x[::-1], axis=0)[::-1]
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def max_pool_flax(x):
  import flax.linen as nn
  return nn.max_pool(x[None], (3,), strides=(1,), padding="SAME")[0]
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def gather_shifted(x):
  idx = jnp.clip(jnp.arange(x.shape[0]) - 2, 0)
  return x[idx]
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def scatter_time(x):
  return jnp.zeros_like(x).at[jnp.arange(x.shape[0])[::-1]].set(x)
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def scatter_max(x):
  return jnp.full(5, -jnp.inf).at[jnp.arange(x.shape[0]) % 5].max(x[:, 0])

@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def head_slice(x):  # dims min(t, 3): JAX evaluates them with constants of the default int
  return x[:3] * 2, x[:3].sum(0)
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def categorical_t(x): return jax.random.categorical(jax.random.key(0), x.T, axis=-1)
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def gumbel_topk(x):
  return lax.top_k(x[:, 0] + jax.random.gumbel(jax.random.key(2), x[:, 0].shape), 2)[1]
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def choice_weighted(x):  # cumsum + searchsorted into the t-long cumulative weights
  return jax.random.choice(jax.random.key(1), jnp.arange(x.shape[0]), (5,),
                           p=jax.nn.softmax(x[:, 0]))
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def choice_weighted_no_replace(x):
  return jax.random.choice(jax.random.key(1), x, (2,), replace=False, p=jax.nn.softmax(x[:, 0]))
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def choice_of_n(x):  # a = the length as a number: JAX takes int() of it
  return jax.random.choice(jax.random.key(1), x.shape[0], (5,), p=jax.nn.softmax(x[:, 0]))
@idiom({"x": "t, 4"}, lambda t: [(t, 4)])
def nucleus_cutoff(x):  # top-p sampling's cutoff over t candidates
  return jnp.searchsorted(jnp.cumsum(jax.nn.softmax(x[:, 0])), 0.7)
