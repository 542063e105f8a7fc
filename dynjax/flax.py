"""Flax wrappers: Linen modules and NNX functions under :func:`dynjax.jit`.

Both are thin layers over :func:`dynjax.jit`.  The model's variables (Linen) or graph state
(NNX) are ordinary arguments whose dimensions are all static; ``dims`` names only the other
arguments, by the parameter names of the wrapped method or function.  ``flax`` is imported
when a wrapper is first built, never by ``import dynjax``.

* :func:`jit` (Linen): ``fn = dynjax.flax.jit(module, method="__call__", dims=...)`` returns
  ``fn(variables, *args, **kwargs)``, which runs ``module.apply(variables, *args,
  method=method, mutable=mutable)``: with ``mutable`` it returns ``(out, updates)`` as
  ``Module.apply`` does.
* :func:`nnx_jit` (NNX), in the manner of ``nnx.jit``: arguments holding NNX graph nodes
  (modules, variables, containers of them) are split into a static ``GraphDef`` and a
  ``State`` outside the dynjax boundary, merged back inside, and every state the function
  changed is written back to the original objects after the call.  Works as a decorator, bare
  or with options, and on methods (``self`` is a module argument like any other).

Costs: on top of :func:`dynjax.jit`'s dispatch, the Linen wrapper adds nothing per call; the
NNX wrapper adds ``nnx.split`` of the module arguments and ``nnx.update`` of the results
(tens of microseconds for small models, growing with the number of variables, as ``nnx.jit``).
Not supported in NNX: creating new variables or changing the module structure inside the
function (the graph definition must not change), and returning graph nodes.

Example:
  >>> import dynjax, dynjax.flax
  >>> fn = dynjax.flax.jit(model, dims={"tokens": "b, t", "lengths": "b"},
  ...                      buckets={"t": dynjax.buckets.pow2(16, 512)})
  >>> fn(variables, tokens, lengths)
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from dynjax._errors import SpecError
from dynjax.jit._args import call_in_order

__all__ = ["jit", "nnx_jit"]

_P = inspect.Parameter


def _jit():
  from dynjax.jit import jit  # lazily: the core imports jax machinery we do not need at import

  return jit


def _as_names(value: str | Sequence[str]) -> tuple[str, ...]:
  return (value,) if isinstance(value, str) else tuple(value)


def _named_parameters(fun: Callable, skip_first: bool, where: str) -> list[inspect.Parameter]:
  try:
    params = list(inspect.signature(fun).parameters.values())
  except (TypeError, ValueError):
    raise SpecError(f"{where}: cannot read the signature of {fun!r}") from None
  if skip_first:
    params = params[1:]
  bad = [p.name for p in params if p.kind in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD)]
  if bad:
    raise SpecError(f"{where}: {getattr(fun, '__qualname__', fun)} has *args/**kwargs "
                    f"parameters {bad}; dims name arguments, so dynjax needs named parameters. "
                    "Give the method explicit parameters.")
  # Positional-only parameters become positional-or-keyword: dynjax calls by name.
  return [p.replace(kind=_P.POSITIONAL_OR_KEYWORD) if p.kind == _P.POSITIONAL_ONLY else p
          for p in params]


def _call_in_order(fun, params: Sequence[inspect.Parameter], values: Mapping[str, Any],
                   prefix: tuple = ()):
  """Calls ``fun(*prefix, ...)`` passing positional parameters by position, keyword-only by
  name; a parameter missing from ``values`` (the caller left it out) is not passed, so ``fun``
  takes its default (a Python value, as under ``jax.jit``: ``train: bool = False`` stays a
  bool), and the positional ones after it go by name."""
  args, kwargs = call_in_order(params, values)
  return fun(*prefix, *args, **kwargs)


# -----------------------------------------------------------------------------------------------
# Linen
# -----------------------------------------------------------------------------------------------
def jit(module, method: str | Callable = "__call__", *, dims: Mapping[str, Any] | str = "auto",
        buckets=None, mutable: Any = False, static_argnames: str | Sequence[str] = (),
        **jit_kwargs):
  """Wraps a Linen module's method as ``fn(variables, *args, **kwargs)`` under dynjax.jit.

  Args:
    module: a ``flax.linen.Module`` instance (unbound).
    method: the method to run, by name or as a function taking the module first (as
      ``Module.apply``'s ``method``).
    dims: parameter name of ``method`` -> shape spec (see :func:`dynjax.jit`), or ``"auto"``.
      ``variables`` needs no entry: all its dimensions are static.
    buckets: as in :func:`dynjax.jit`.
    mutable: as in ``Module.apply``; when not False, ``fn`` returns ``(out, updates)``.
    static_argnames: parameters of ``method`` that are static (hashable) values.
    **jit_kwargs: any other :func:`dynjax.jit` option (``padding``, ``on_fallback``, ``overflow``,
      ``return_padded``, ``max_executables``, ``cache_dir``, ...).  Pass ``rngs=`` at call time
      for methods that need randomness (dropout): it is a dynamic argument like ``variables``.

  Returns:
    A :class:`dynjax.Wrapped` function ``fn(variables, *args, rngs=None, **kwargs)`` with
    ``stats()``, ``explain()`` and ``warmup(variables, *example_args)``.

  Example:
    >>> model = BertEncoder(cfg)
    >>> fn = dynjax.flax.jit(model, dims={"tokens": "b, t", "lengths": "b"},
    ...                      buckets={"t": dynjax.buckets.pow2(16, 512)}, padding="trust")
    >>> pooled = fn({"params": params}, tokens, lengths)   # exact-shape output
  """
  import flax.linen as nn

  if not isinstance(module, nn.Module):
    raise SpecError(f"dynjax.flax.jit: expected a flax.linen.Module instance, got "
                    f"{type(module).__name__}; for NNX modules use dynjax.flax.nnx_jit")
  if isinstance(method, str):
    target = getattr(type(module), method, None)
    if target is None or not callable(target):
      raise SpecError(f"dynjax.flax.jit: {type(module).__name__} has no method {method!r}")
    label = f"{type(module).__name__}.{method}"
  elif callable(method):
    target = method
    label = f"{type(module).__name__}.{getattr(method, '__name__', 'method')}"
  else:
    raise SpecError(f"dynjax.flax.jit: method must be a method name or a function, got "
                    f"{type(method).__name__}")
  params = _named_parameters(target, True, "dynjax.flax.jit")
  taken = {p.name for p in params}
  for reserved in ("variables", "rngs"):
    if reserved in taken:
      raise SpecError(f"dynjax.flax.jit: {label} has a parameter named {reserved!r}, which the "
                      f"wrapper uses for Module.apply's own argument; rename it")
  if isinstance(dims, Mapping) and "variables" in dims:
    raise SpecError("dynjax.flax.jit: dims names 'variables'; the variables' dimensions are "
                    "static, give dims only for the method's own arguments")

  keyword_only = [p for p in params if p.kind == _P.KEYWORD_ONLY]
  positional = [p for p in params if p.kind != _P.KEYWORD_ONLY]
  signature = inspect.Signature(
      [_P("variables", _P.POSITIONAL_OR_KEYWORD), *positional,
       *keyword_only, _P("rngs", _P.KEYWORD_ONLY, default=None)])

  def apply(*args, **kwargs):  # called as the signature says; left-out arguments not passed
    kw = dict(signature.bind(*args, **kwargs).arguments)
    variables, rngs = kw.pop("variables"), kw.pop("rngs", None)
    extra = {} if rngs is None else {"rngs": rngs}
    return _call_in_order(
        functools.partial(module.apply, variables, method=method, mutable=mutable, **extra),
        params, kw)

  apply.__signature__ = signature
  apply.__name__ = label.replace(".", "_")
  apply.__qualname__ = label
  apply.__doc__ = getattr(target, "__doc__", None)
  return _jit()(apply, dims=dims, buckets=buckets, static_argnames=static_argnames,
                **jit_kwargs)


# -----------------------------------------------------------------------------------------------
# NNX
# -----------------------------------------------------------------------------------------------
_GRAPHDEF = "nnx_graphdef__"
_STATE = "nnx_state__"


class _GraphKey:
  """A GraphDef as a static argument: equal when the graph definitions are equal.

  A module whose config holds a list (Gemma's ``attention_types``) has a GraphDef that
  ``hash()`` refuses, while ``nnx.jit`` runs it; such a GraphDef is hashed by its repr
  (computed once per call: tens of microseconds for a large model), others by their own hash.
  """

  __slots__ = ("graphdef", "_hash")

  def __init__(self, graphdef):
    self.graphdef = graphdef
    try:
      self._hash = hash(graphdef)
    except TypeError:
      self._hash = hash(repr(graphdef))

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other) -> bool:
    return (type(other) is _GraphKey and self._hash == other._hash
            and self.graphdef == other.graphdef)

  def __repr__(self) -> str:
    return f"GraphKey({type(self.graphdef).__name__})"


@functools.cache
def _graph_node_types() -> tuple[type, ...]:
  from flax import nnx

  types = [nnx.Variable]
  for name in ("Pytree", "Object", "Module"):
    t = getattr(nnx, name, None)
    if isinstance(t, type):
      types.append(t)
  return tuple(types)


def _holds_graph_nodes(value) -> bool:
  types = _graph_node_types()
  if isinstance(value, types):
    return True
  if isinstance(value, list | tuple | dict):
    leaves = jax.tree_util.tree_leaves(value, is_leaf=lambda x: isinstance(x, types))
    return any(isinstance(x, types) for x in leaves)
  return False


class NnxWrapped:
  """A function wrapped by :func:`nnx_jit`; call it like the original.

  One :func:`dynjax.jit` function is kept per set of arguments that hold graph nodes
  (usually one); ``stats()`` adds their counters, ``explain()`` joins their reports.
  """

  def __init__(self, fun: Callable, dims, buckets, static_argnames, jit_kwargs):
    self.fun = fun
    self._params = _named_parameters(fun, False, "dynjax.flax.nnx_jit")
    self._names = [p.name for p in self._params]
    self._sig = inspect.Signature(self._params)
    self._dims = dims
    self._buckets = buckets
    self._static = _as_names(static_argnames)
    unknown = [n for n in self._static if n not in self._names]
    if unknown:
      raise SpecError(f"dynjax.flax.nnx_jit: static_argnames {unknown} are not parameters of "
                      f"{getattr(fun, '__qualname__', fun)}; its parameters are {self._names}")
    self._jit_kwargs = dict(jit_kwargs)
    self._inner: dict[tuple[str, ...], Any] = {}
    functools.update_wrapper(self, fun)

  def __get__(self, obj, objtype=None):
    if obj is None:
      return self
    return functools.partial(self, obj)

  def _build(self, graph_names: tuple[str, ...]):
    fun, params = self.fun, self._params
    dims = self._dims
    if isinstance(dims, Mapping):
      bad = [n for n in dims if n in graph_names]
      if bad:
        raise SpecError(f"dynjax.flax.nnx_jit: dims names {bad}, which hold NNX modules or "
                        "variables; their dimensions are static, give dims only for the other "
                        "arguments")
    from flax import nnx

    def inner(**kw):  # by keyword (the signature below); left-out arguments not passed
      graphdef, state = kw.pop(_GRAPHDEF).graphdef, kw.pop(_STATE)
      nodes = nnx.merge(graphdef, state)
      values = dict(kw)
      values.update(zip(graph_names, nodes, strict=True))
      out = _call_in_order(fun, params, values)
      _, new_state = nnx.split(nodes)
      return out, new_state

    rest = [p for p in params if p.name not in graph_names]
    inner.__signature__ = inspect.Signature(
        [_P(_GRAPHDEF, _P.KEYWORD_ONLY), _P(_STATE, _P.KEYWORD_ONLY),
         *[p.replace(kind=_P.KEYWORD_ONLY) for p in rest]])
    inner.__name__ = getattr(fun, "__name__", "nnx_fn")
    inner.__qualname__ = getattr(fun, "__qualname__", inner.__name__)
    static = (_GRAPHDEF, *[n for n in self._static if n not in graph_names])
    return _jit()(inner, dims=dims, buckets=self._buckets, static_argnames=static,
                  **self._jit_kwargs)

  def _prepare(self, args, kwargs):
    try:
      bound = self._sig.bind(*args, **kwargs)
    except TypeError as e:
      raise TypeError(f"{getattr(self.fun, '__qualname__', self.fun)}(): {e}") from None
    values = bound.arguments  # left-out arguments stay out: the function's defaults apply
    graph_names = tuple(n for n in self._names if n in values
                        and _holds_graph_nodes(values[n]))
    wrapped = self._inner.get(graph_names)
    if wrapped is None:
      wrapped = self._inner[graph_names] = self._build(graph_names)
    return wrapped, graph_names, values

  def _split(self, graph_names, values):
    from flax import nnx

    nodes = tuple(values[n] for n in graph_names)
    graphdef, state = nnx.split(nodes)
    call = {_GRAPHDEF: _GraphKey(graphdef), _STATE: state}
    call.update((n, values[n]) for n in self._names if n not in graph_names and n in values)
    return nodes, call

  def __call__(self, *args, **kwargs):
    from flax import nnx

    _take_static_cache()
    wrapped, graph_names, values = self._prepare(args, kwargs)
    nodes, call = self._split(graph_names, values)
    out, new_state = wrapped(**call)
    # Numpy inputs get numpy outputs for outputs with dims: state with dims (or of a family
    # with none) then comes back as numpy (a few us to see; the fix-up flattens the state).
    rest = [v for k, v in call.items() if k not in (_GRAPHDEF, _STATE)]
    if (_state_may_be_numpy(wrapped)
        and any(type(x) is np.ndarray for x in jax.tree_util.tree_leaves(rest))):
      new_state = _state_where_it_was(new_state, call[_STATE])
    nnx.update(nodes, new_state)
    return out

  def warmup(self, *args, progress: bool | None = None, max_workers: int | None = None,
             background: bool = False, **kwargs) -> dict:
    """Compiles every bucket for example arguments (see ``dynjax.jit(...).warmup``; an
    abstract model from ``nnx.eval_shape`` and ``jax.ShapeDtypeStruct`` inputs work too)."""
    wrapped, graph_names, values = self._prepare(args, kwargs)
    _, call = self._split(graph_names, values)
    return wrapped.warmup(progress=progress, max_workers=max_workers, background=background,
                          **call)

  def stats(self) -> dict:
    """The dynjax counters, added over the inner functions (see ``dynjax.jit(...).stats``)."""
    from dynjax.jit._stats import combine

    return combine([w.stats() for w in self._inner.values()])

  def explain(self) -> str:
    """The dynjax reports of the inner functions."""
    if not self._inner:
      return f"dynjax.flax.nnx_jit({self.__name__}): not called yet"
    return "\n".join(w.explain() for w in self._inner.values())

  def __repr__(self) -> str:
    return f"<dynjax.flax.nnx_jit {getattr(self.fun, '__qualname__', self.fun)}>"


@functools.cache
def _graph_context():
  from flax.nnx import graphlib

  return getattr(graphlib, "GRAPH_CONTEXT", None)


def _take_static_cache() -> None:
  """Takes the traversal cache ``nnx.cached_partial(f, model, ...)`` hands ``f``.

  ``cached_partial`` puts its cache in flax's graph context for the NNX transform it wraps to
  take, and raises when the call returns and nobody took it ("GRAPH_CONTEXT.tmp_static_cache
  should be None, no context consumed it"): after the function ran and updated the model.
  ``nnx_jit`` splits its arguments itself, so it takes the cache and drops it: the cached
  arguments are clones sharing their Variables with the caller's, so the updates it writes to
  them reach the caller's model, as under ``nnx.jit`` (less the traversal it saves).  One
  attribute read a call.
  """
  ctx = _graph_context()
  if ctx is not None and getattr(ctx, "tmp_static_cache", None) is not None:
    ctx.tmp_static_cache = None


def _state_may_be_numpy(wrapped) -> bool:
  """Whether a host request to ``wrapped`` can return state leaves as numpy: a family with
  no dims (everything comes back as the request came), one without a symbolic trace, or
  state outputs with dims; state without dims comes back as device arrays.  Cached per count
  of families (they only grow until ``clear_cache``)."""
  fams = wrapped._dispatcher.all_families
  known = wrapped.__dict__.get("_dynjax_state_numpy")
  if known is not None and known[0] == len(fams):
    return known[1]
  may = False
  for fam in list(fams.values()):
    tree = fam.out_tree
    if not fam.sig.var_order or tree is None or len(tree.children()) != 2:
      may = True
      break
    n = tree.children()[1].num_leaves  # (out, new_state): the state is the last leaves
    if n and any(fam.out_dynamic[-n:]):
      may = True
      break
  wrapped.__dict__["_dynjax_state_numpy"] = (len(fams), may)
  return may


def _state_where_it_was(new, old):
  """The updated state, its changed device arrays back on their devices: a host request
  (numpy inputs) gets numpy outputs, and a changed BatchNorm statistic must not become a numpy
  array in the model (unchanged leaves come back as the caller's own objects: jit/_forward.py).
  Costs a flatten of the state: 266 us for 200 leaves with nothing changed (2-core CPU box,
  an NNX State), hence only for calls with numpy inputs."""
  leaves, tree = jax.tree_util.tree_flatten(new)
  if not any(type(x) is np.ndarray for x in leaves):
    return new
  before = jax.tree_util.tree_leaves(old)
  if len(before) != len(leaves):  # the function added or removed variables: as it came
    return new
  return jax.tree_util.tree_unflatten(tree, [
      jax.device_put(x, b.sharding) if type(x) is np.ndarray and isinstance(b, jax.Array)
      else x for x, b in zip(leaves, before, strict=True)])


def nnx_jit(fun: Callable | None = None, *, dims: Mapping[str, Any] | str = "auto",
            buckets=None, static_argnames: str | Sequence[str] = (), **jit_kwargs):
  """``nnx.jit`` with dynamic shapes: NNX graph split outside, merged inside, updates written back.

  Args:
    fun: a function whose arguments may hold NNX modules/variables (also a method: ``self``
      is such an argument).  Omit it to use ``nnx_jit(dims=...)`` as a decorator.
    dims: parameter name -> shape spec for the arguments that are arrays (see
      :func:`dynjax.jit`), or ``"auto"``.  Arguments holding graph nodes need no entry.
    buckets: as in :func:`dynjax.jit`.
    static_argnames: parameters that are static (hashable) values.
    **jit_kwargs: any other :func:`dynjax.jit` option (``padding``, ``on_fallback``, ``overflow``, ...).

  Returns:
    An :class:`NnxWrapped` callable (or a decorator), with ``stats()``, ``explain()``,
    ``warmup(*example_args)``.

  Example:
    >>> @dynjax.flax.nnx_jit(dims={"x": "b, t, 16", "lengths": "b"}, padding="trust")
    ... def train_step(model, x, lengths, y):
    ...   grads = nnx.grad(loss_fn)(model, x, lengths, y)
    ...   params = nnx.state(model, nnx.Param)
    ...   nnx.update(model, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads))
    >>> train_step(model, x, lengths, y)   # model's parameters are updated in place
  """
  if fun is None:
    return lambda f: NnxWrapped(f, dims, buckets, static_argnames, jit_kwargs)
  if not callable(fun):
    raise SpecError(f"dynjax.flax.nnx_jit: expected a function, got {type(fun).__name__}")
  return NnxWrapped(fun, dims, buckets, static_argnames, jit_kwargs)
