"""Every option of ``dynjax.jit``, checked once at ``jit()`` time.

Errors list the legal values and name the argument (``SpecError``); nothing here is on a
call's path.  :class:`Policies` hands out one bucket policy per dimension variable.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax import export

from dynjax import _symbolic
from dynjax._config import config
from dynjax._errors import SpecError, format_list
from dynjax.bucketing._policies import BucketPolicy, as_policy, pow2
from dynjax.jit import _sharding

PADDING_MODES = ("auto", "trust", "exact")
OVERFLOW_MODES = ("error", "exact", "grow")
ON_FALLBACK = ("warn", "error")
ATTENTION = (None, "cudnn", "pallas", "xla")
_AUTO_VAR = re.compile(r"^d[0-9]+$")


@dataclasses.dataclass
class Options:
  """The validated options of one ``dynjax.jit`` function."""

  dims: Any  # "auto" or dict parameter name -> spec pytree
  buckets: Any  # None, one BucketPolicy, or dict variable -> BucketPolicy
  padding: str
  overflow: str
  static_argnames: tuple[str, ...]
  donate_argnames: tuple[str, ...]
  return_padded: bool
  constraints: tuple[str, ...]
  max_executables: int | None
  check: bool
  async_compile: bool
  sharding: Any = None  # jit._sharding.ShardingOptions, or None (one device)
  serving: bool = False
  compile_workers: int = 1
  compiler_options: tuple = ()  # sorted (name, value) pairs
  store_root: str | None = None  # where serialized executables live (cache_dir)
  cache_dir: str | None = None
  on_fallback: str = "warn"
  attention: str | None = None  # rewrite attention to jax.nn.dot_product_attention
  cast_once: bool = True  # parameters the function only casts narrower: cast once (_casts)
  host_outputs: bool | None = None  # outputs in pinned host memory (_placement)
  ragged_dot: str | None = None  # lax.ragged_dot rewritten to route.ragged_dot (route/_rewrite)


def check(name: str, param_names: list[str], dyn_names: tuple[str, ...], *, dims, buckets,
          padding, overflow, static_argnames, donate_argnames, return_padded, constraints,
          max_executables, cache_dir, check, async_compile, in_shardings, out_shardings,
          serving, compile_workers, compiler_options, on_fallback,
          attention=None, cast_once=True, host_outputs=None, ragged_dot=None,
          var_keyword: bool = False) -> Options:
  """Validates every option of ``dynjax.jit(fun, ...)``; ``SpecError`` names what is wrong.
  ``var_keyword``: ``fun`` takes ``**kwargs``, where static_argnames may also point (as
  ``jax.jit`` allows: ``jax.jit(model.apply, static_argnames="train")``)."""
  static = names(static_argnames, "static_argnames")
  donate = names(donate_argnames, "donate_argnames")
  for what, group in (("static_argnames", static), ("donate_argnames", donate)):
    unknown = [n for n in group if n not in param_names
               and not (var_keyword and what == "static_argnames")]
    if unknown:
      raise SpecError(f"{what}: {unknown} are not parameters of {name}; its "
                      f"parameters are {param_names}")
  if max_executables is not None and (isinstance(max_executables, bool) or not isinstance(
      max_executables, int) or max_executables < 1):
    raise SpecError(f"max_executables must be a positive integer or None, got "
                    f"{max_executables!r}")
  if compile_workers is not None and (isinstance(compile_workers, bool) or not isinstance(
      compile_workers, int) or compile_workers < 1):
    raise SpecError(f"compile_workers must be a positive integer or None, got "
                    f"{compile_workers!r}")
  dims, declared = _check_dims(dims, name, param_names, static)
  cache_dir = cache_dir or config.cache_dir
  return Options(
      dims=dims,
      buckets=_check_buckets(buckets, declared),
      padding=choice(padding, PADDING_MODES, "padding"),
      overflow=choice(overflow, OVERFLOW_MODES, "overflow"),
      static_argnames=static, donate_argnames=donate, return_padded=bool(return_padded),
      constraints=tuple(constraints), max_executables=max_executables,
      check=config.check if check is None else bool(check),
      async_compile=bool(async_compile) or bool(serving), serving=bool(serving),
      compile_workers=compile_workers or default_workers(),
      compiler_options=_check_compiler_options(compiler_options),
      sharding=_sharding.check_options(in_shardings, out_shardings, dyn_names, static, name),
      cache_dir=os.fspath(cache_dir) if cache_dir else None,
      store_root=(os.path.join(os.fspath(cache_dir), "dynjax-executables") if cache_dir
                  else None),
      on_fallback=choice(on_fallback, ON_FALLBACK, "on_fallback"),
      attention=_check_attention(attention, padding),
      cast_once=_check_bool(cast_once, "cast_once"),
      host_outputs=None if host_outputs is None else _check_bool(host_outputs, "host_outputs",
                                                                 "True, False or None"),
      ragged_dot=_check_ragged_dot(ragged_dot))


def _check_bool(value, what: str, legal: str = "True or False") -> bool:
  if not isinstance(value, bool | np.bool_):
    raise SpecError(f"{what} must be {legal}, got {value!r}")
  return bool(value)


def names(value, what: str) -> tuple[str, ...]:
  if isinstance(value, str):
    return (value,)
  try:
    out = tuple(value)
  except TypeError:
    raise SpecError(f"{what}: expected a name or a sequence of names, got {value!r}") from None
  for v in out:
    if not isinstance(v, str):
      raise SpecError(f"{what}: expected parameter names (str), got {v!r}")
  return out


def argnums(value, param_names: list[str], what: str, name: str,
            var_args: bool = False) -> tuple[str, ...]:
  """The parameter names at ``jax.jit``-style positions (an int or ints; negative from the
  end) among ``param_names``, the parameters a call's positions fill (up to ``*args``)."""
  nums = (value,) if isinstance(value, int) else value
  try:
    nums = tuple(nums)
  except TypeError:
    raise SpecError(f"{what}: expected a position or a sequence of positions, got "
                    f"{value!r}") from None
  out = []
  for i in nums:
    if not isinstance(i, int) or isinstance(i, bool):
      raise SpecError(f"{what}: expected parameter positions (int), got {i!r}")
    if var_args and not -len(param_names) <= i < len(param_names):
      raise SpecError(
          f"{what}={value!r}: position {i} of {name} falls in its *args (its named positional "
          f"parameters are {param_names}); dynjax takes static arguments by parameter. "
          "Non-array leaves (Python bools, strings, None, functions) are static already; "
          "for a Python number, pass it by keyword and name it in static_argnames, or wrap "
          "the function in one with named parameters")
    if not -len(param_names) <= i < len(param_names):
      raise SpecError(f"{what}={value!r}: {name} has {len(param_names)} positional "
                      f"parameters {param_names}; position {i} is not one of them")
    out.append(param_names[i])
  return tuple(out)


def choice(value, legal, what: str) -> str:
  if value not in legal:
    raise SpecError(f"{what}={value!r} is not valid; use one of {', '.join(map(repr, legal))}")
  return value


def _check_dims(dims, name: str, param_names: list[str], static: tuple[str, ...]):
  """(dims, declared variables or None)."""
  if isinstance(dims, str):
    if dims != "auto":
      raise SpecError(f"dims={dims!r}: a single string must be \"auto\"; give a dict "
                      f"mapping parameter names to specs, e.g. {{{param_names[0]!r}: \"b, t\"}}"
                      if param_names else f"dims={dims!r} is not valid")
    return "auto", None
  if not isinstance(dims, Mapping):
    raise SpecError(f"dims: expected a dict of parameter name -> shape spec, or \"auto\"; got "
                    f"{type(dims).__name__}")
  unknown = [k for k in dims if k not in param_names]
  if unknown:
    raise SpecError(f"dims names {unknown}, which are not parameters of {name}; "
                    f"its parameters are {param_names}")
  in_static = [k for k in dims if k in static]
  if in_static:
    raise SpecError(f"dims names {in_static}, which are in static_argnames; static arguments "
                    "have no shapes to declare")
  texts, bad = [], []
  for path, v in jax.tree_util.tree_flatten_with_path(dict(dims))[0]:
    where = f"dims{jax.tree_util.keystr(path)}"
    if not isinstance(v, str):
      bad.append(f"{where}: expected a string like \"b, t\" (or None), got "
                 f"{type(v).__name__} {v!r}")
      continue
    try:
      parsed = export.symbolic_shape(v)
    except Exception as e:  # noqa: BLE001 - jax explains the syntax error in its message
      first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
      bad.append(f"{where} = {v!r} does not parse: {first}")
      continue
    negative = [str(d) for d in parsed if not _symbolic.is_symbolic(d) and int(d) < 0]
    if negative:
      bad.append(f"{where} = {v!r} has the negative size(s) {negative}")
      continue
    texts.append(v)
  if bad:
    raise SpecError(f"dims of {name}:\n" + format_list(bad)
                    + "\nWrite each spec in jax.export.symbolic_shape syntax: names or sizes "
                    "separated by commas, e.g. \"b, t, 768\".")
  return dict(dims), _symbolic.spec_variables(texts)


def _check_buckets(buckets, declared):
  if buckets is None:
    return None
  if isinstance(buckets, Mapping):
    out = {k: as_policy(v, f"[{k!r}]") for k, v in buckets.items()}
    if declared is None:  # dims="auto": its variables are d0, d1, ... as axes become dynamic
      unknown = [k for k in out if not _AUTO_VAR.match(str(k))]
      if unknown:
        raise SpecError(
            f"buckets names {unknown}, but with dims=\"auto\" the dimension variables are "
            "named d0, d1, ... in the order axes turn dynamic, so these policies would never "
            "apply. Declare dims (e.g. dims={\"x\": \"b, t\"}) to name the variables, or "
            "pass one policy for every variable (buckets=dynjax.buckets.pow2(16, 512)).")
    else:
      unknown = [k for k in out if k not in declared]
      if unknown:
        raise SpecError(f"buckets names {unknown}, which are not dimension variables of dims; "
                        f"the variables are {declared}")
    return out
  return as_policy(buckets, "")


def _check_compiler_options(options) -> tuple:
  if options is None:
    return ()
  if not isinstance(options, Mapping):
    raise SpecError(f"compiler_options must be a dict of XLA option name -> value, got "
                    f"{type(options).__name__}")
  bad = [k for k, v in options.items()
         if not isinstance(k, str) or not isinstance(v, bool | int | float | str)]
  if bad:
    raise SpecError(f"compiler_options: {bad} are not name -> bool/int/float/str pairs")
  return tuple(sorted(options.items()))


def _check_attention(attention, padding) -> str | None:
  if attention not in ATTENTION:
    raise SpecError(
        f"attention={attention!r} is not valid; use one of {', '.join(map(repr, ATTENTION))}: "
        "None (default) keeps the function's own attention; \"cudnn\" rewrites scaled-dot-"
        "product attention to jax.nn.dot_product_attention(implementation=\"cudnn\") where "
        "cuDNN takes it (GPU, float16/bfloat16) and says in explain() why elsewhere; \"pallas\" "
        "to dynjax's Pallas flash attention (GPU, float32 too, key masks only); \"xla\" "
        "rewrites it to implementation=\"xla\" (any backend)")
  if attention is not None and padding == "exact":
    raise SpecError(f"attention={attention!r} needs padding=\"auto\" or \"trust\"; with "
                    "padding=\"exact\" the function runs as written (use jax.nn."
                    "dot_product_attention in it instead)")
  return attention


def _check_ragged_dot(ragged_dot) -> str | None:
  if ragged_dot not in (None, "kernels"):
    raise SpecError(
        f"ragged_dot={ragged_dot!r} is not valid; use None (default: jax.lax.ragged_dot runs "
        "as written) or \"kernels\" (it runs as dynjax.route.ragged_dot: the grouped-GEMM "
        "kernels where they apply, lax.ragged_dot elsewhere)")
  return ragged_dot


def default_workers() -> int:
  n = os.cpu_count() or 2
  return 1 if n <= 4 else min(4, n // 4)


class Policies:
  """One bucket policy per dimension variable of a function, shared by its families."""

  def __init__(self, buckets, serving=None):
    self.buckets = buckets
    # ``() -> bool``, asked when a policy is first made (not at decoration: it may start the
    # backend): does ``auto()`` without ``max_compiles`` get the serving budget here?
    self.serving = serving
    self.by_var: dict[str, BucketPolicy] = {}

  def for_var(self, var: str) -> BucketPolicy:
    p = self.by_var.get(var)
    if p is None:
      b = self.buckets
      base = b.get(var) if isinstance(b, dict) else b
      p = pow2() if base is None else base.fresh()
      if hasattr(p, "for_serving") and self.serving is not None and self.serving():
        p = p.for_serving()  # auto() serving on a GPU: a larger default budget
      self.by_var[var] = p
    return p

  def aligned(self, var: str, multiple: int) -> BucketPolicy:
    """The variable's policy with bucket sizes that are multiples of ``multiple`` (a sharded
    axis); it replaces the variable's policy for every later family."""
    p = self.for_var(var)
    if multiple > 1 and p.multiple % multiple:
      p = self.by_var[var] = p.aligned(multiple)
    return p

  def describe(self) -> dict[str, str]:
    return {v: repr(p) for v, p in self.by_var.items()}
