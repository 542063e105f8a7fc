"""Arguments of a ``dynjax.jit`` call: binding to parameters, leaves, and ``dims="auto"``.

:class:`Binder` turns ``(*args, **kwargs)`` into (static key, dynamic values) in parameter
order, builds the flat function a family traces, and reads each leaf's dims spec.  The leaf
helpers (:func:`leaf_key`, :func:`aval`, :func:`on_device`) are the hot path's type tests:
each is written to avoid ABC ``isinstance`` checks (~0.8 us each on the 2-core CPU box).
"""

from __future__ import annotations

import inspect
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from dynjax import _jax_private
from dynjax._errors import SpecError
from dynjax._padded import Padded

_VAR_POS = inspect.Parameter.VAR_POSITIONAL
_VAR_KW = inspect.Parameter.VAR_KEYWORD
tree_flatten = jax.tree_util.tree_flatten
tree_unflatten = jax.tree_util.tree_unflatten
LEAF_TREEDEF = jax.tree_util.tree_structure(0)
# The concrete jax.Array class, for exact type tests (named, not made: making an array here
# started the backend inside ``import dynjax``).
ARRAY_IMPL = _ARRAY_IMPL = _jax_private.array_impl()


def is_padded(x) -> bool:
  return type(x) is Padded


def has_tracer(tree) -> bool:
  """Whether a pytree holds a jax tracer (only asked on failures and new families)."""
  return any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(tree))


class _Omitted:
  """An argument the caller left out: the function is called without it and takes its own
  default, as ``jax.jit`` calls it (a default is a Python value, never traced).  An empty
  pytree, so it adds no leaf, and a node of its own, so leaving an argument out is another
  family than passing it."""

  __slots__ = ()

  def __repr__(self):
    return "<default>"


OMITTED = _Omitted()
jax.tree_util.register_pytree_node(_Omitted, lambda _: ((), None), lambda _, __: OMITTED)


# -- leaves that are not arrays (an Equinox module's activation function, a string) ---------
PY_SCALARS = (bool, int, float, complex)
_TRACED_TYPES = (jax.Array, np.ndarray, np.generic, bool, int, float, complex,
                 jax.ShapeDtypeStruct, Padded)


def is_static_leaf(x) -> bool:
  """A leaf no JAX type can hold (a function, a string, any object without ``__array__``):
  ``jax.jit`` refuses it; dynjax holds it as part of the family's key, as ``eqx.filter_jit``
  does.  Python numbers stay traced (weakly typed), as ``jax.jit`` traces them."""
  return not (isinstance(x, _TRACED_TYPES) or hasattr(x, "__jax_array__")
              or hasattr(x, "__array__"))


class _Static:
  """A static leaf inside a treedef: no children, the value as the node's aux data (so the
  treedef hashes and compares it), and unflattening gives back the value itself."""

  __slots__ = ("value",)

  def __init__(self, value):
    self.value = value


jax.tree_util.register_pytree_node(_Static, lambda s: ((), s.value), lambda value, _: value)


class StaticLeaves:
  """The static leaves of one call's flat leaves (positions and values) and the two treedefs
  built from the arguments: ``fun_tree`` unflattens the other leaves into the arguments with
  the static values in place (the function's view), ``exec_tree`` with None there (the
  executables' pytrees: what ``eqx.partition(args, eqx.is_array)`` gives)."""

  __slots__ = ("items", "kept", "fun_tree", "exec_tree")

  def __init__(self, items, kept, fun_tree, exec_tree):
    self.items, self.kept, self.fun_tree, self.exec_tree = items, kept, fun_tree, exec_tree

  @classmethod
  def find(cls, name: str, binder: Binder, dyn, leaves,
           scalars: bool = False) -> StaticLeaves | None:
    """None when every leaf is an array or number (the common case).  ``scalars``: Python
    numbers are static too (the function could not trace them: ``if self.inference:``).
    Raises a SpecError listing every static leaf that cannot be hashed (it could not key a
    family)."""
    static = (lambda x: type(x) in PY_SCALARS or is_static_leaf(x)) if scalars else is_static_leaf
    items = tuple((i, x) for i, x in enumerate(leaves) if static(x))
    if not items:
      return None
    paths = binder.leaf_paths(dyn)
    bad = []
    for i, x in items:
      try:
        hash(x)
      except TypeError:
        bad.append(f"  {paths[i]}: {type(x).__name__} (unhashable)")
    if bad:
      raise SpecError(
          f"{name}(): arguments hold leaves that are not arrays, which dynjax keeps static "
          "(part of the compiled function's key, as eqx.filter_jit does), but they cannot be "
          "hashed:\n" + "\n".join(bad) + "\nFix: make them hashable (a frozen dataclass, a "
          "tuple), turn them into arrays, or pass them through static_argnames.")
    static_at = {i for i, _ in items}
    wrap = lambda x: _Static(x) if static(x) else x  # noqa: E731
    hole = lambda x: None if static(x) else x  # noqa: E731
    return cls(items, tuple(i for i in range(len(leaves)) if i not in static_at),
               jax.tree_util.tree_structure(jax.tree_util.tree_map(wrap, dyn, is_leaf=is_padded),
                                            is_leaf=is_padded),
               jax.tree_util.tree_structure(jax.tree_util.tree_map(hole, dyn, is_leaf=is_padded),
                                            is_leaf=is_padded))

  def strip(self, leaves):
    """The leaves without the static ones, or None where a static value differs from this
    family's (another family: the slow path finds or builds it)."""
    for i, v in self.items:
      x = leaves[i]
      if x is not v and not (type(x) is type(v) and x == v):
        return None
    return [leaves[i] for i in self.kept]

  def keep(self, seq) -> list:
    return [seq[i] for i in self.kept]


def static_outputs(out, scalars: bool = False):
  """``(leaves, treedef)`` of a function's output, any static leaf (a returned Equinox module's
  activation function; ``scalars``: Python numbers too) held in the treedef, so the computation
  returns arrays only."""
  static = (lambda x: type(x) in PY_SCALARS or is_static_leaf(x)) if scalars else is_static_leaf
  leaves, tree = tree_flatten(out)
  if any(map(static, leaves)):
    leaves, tree = tree_flatten(jax.tree_util.tree_map(
        lambda x: _Static(x) if static(x) else x, out))
  return leaves, tree


class _Texts(list):
  """The spec texts of one dims spec's leaves: a pytree leaf (a plain list is a node, and a
  list of specs matches a list argument: Keras's ``model([encoder_ids, decoder_ids])``)."""


class Binder:
  """Binds calls of one function to its parameters (static ones taken out)."""

  def __init__(self, fun, name: str, static: tuple[str, ...]):
    self.fun = fun
    self.name = name
    self.params = params = parameters(fun)
    kinds = [p.kind for p in params]
    # ``*args`` binds as one parameter holding a tuple, ``**kwargs`` as one holding a dict
    # (``jax.jit(model.apply)``: dims={"args": (None, "b, t")} or "auto").
    self.var_pos = kinds.index(_VAR_POS) if _VAR_POS in kinds else None
    self.var_kw = kinds.index(_VAR_KW) if _VAR_KW in kinds else None
    self.names = [p.name for p in params]
    self.static_pos = tuple(i for i, p in enumerate(params) if p.name in static)
    # static_argnames that no parameter names go into **kwargs, as under jax.jit.
    self.kw_static = (tuple(n for n in static if n not in self.names)
                      if self.var_kw is not None else ())
    self.static_names = tuple(params[i].name for i in self.static_pos) + self.kw_static
    self.dyn_names = tuple(p.name for p in params if p.name not in static)
    self.nparams = len(params)
    self.defaults = tuple(p.default for p in params)
    self.omitted = (OMITTED,) * self.nparams
    # Calls with only positional arguments may leave out trailing parameters with defaults
    # (keyword-only ones too, e.g. the Flax wrapper's rngs=None).
    positional = 0
    while positional < self.nparams and kinds[positional] in (
        inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
      positional += 1
    first_default = self.nparams
    while first_default > 0 and self.defaults[first_default - 1] is not inspect.Parameter.empty:
      first_default -= 1
    # args of length n in [first_default, positional] bind in order, the rest take defaults.
    self.defaults_from = first_default if first_default <= positional else self.nparams
    self.positional = positional
    self.signature = inspect.Signature(params)

  def split(self, args, kwargs):
    """(static key, dynamic values in parameter order). ~1 us with positional args only (also
    when trailing parameters take their defaults, and into ``*args``); ``inspect`` binding
    (~40 us on the GPU host) only with keywords or left-out positionals."""
    params = self.params
    n = len(args)
    if self.var_pos is not None or self.var_kw is not None:
      values = self._split_var(args, kwargs)
    else:
      if not kwargs and self.defaults_from <= n < self.nparams and n <= self.positional:
        args = args + self.omitted[n:]
      if kwargs or len(args) != len(params):
        values = self._bind(args, kwargs)
      else:
        values = args
    if not self.static_names:
      return (), values
    static = tuple(values[i] for i in self.static_pos)
    if self.kw_static:
      values = list(values)
      extra = values[self.var_kw]
      static += tuple(extra.get(k, OMITTED) for k in self.kw_static)
      values[self.var_kw] = {k: v for k, v in extra.items() if k not in self.kw_static}
    try:
      hash(static)
    except TypeError:
      raise SpecError(f"static arguments {list(self.static_names)} must be hashable; got "
                      f"{[type(s).__name__ for s in static]}") from None
    dyn = tuple(v for i, v in enumerate(values) if i not in self.static_pos)
    return static, dyn

  def _bind(self, args, kwargs) -> tuple:
    try:
      bound = self.signature.bind(*args, **kwargs)
    except TypeError as e:
      raise TypeError(f"{self.name}(): {e}") from None
    return tuple(bound.arguments.get(p.name, OMITTED) for p in self.params)

  def _split_var(self, args, kwargs) -> tuple:
    """Values of a function with ``*args`` / ``**kwargs``: those two always a tuple and a
    dict (empty when the call passes none), so a call's tree does not depend on how it was
    written.  Positional calls that fill the named parameters before ``*args`` bind here
    without ``inspect`` (~1 us)."""
    vp, vk = self.var_pos, self.var_kw
    if not kwargs and vp is not None and len(args) >= vp:
      values = list(args[:vp]) + [tuple(args[vp:])] + [OMITTED] * (self.nparams - vp - 1)
    else:
      values = list(self._bind(args, kwargs))
      if vp is not None and values[vp] is OMITTED:
        values[vp] = ()
    if vk is not None and values[vk] is OMITTED:
      values[vk] = {}
    return tuple(values)

  def call_args(self, static, dyn) -> tuple[list, dict]:
    """The call's arguments again, from a static key and the dynamic values: positional
    parameters positionally (``jax.value_and_grad(f)`` differentiates its positional
    arguments; a ``/`` parameter has no keyword), up to the first one left out, the rest by
    keyword; the ones left out not at all (the function takes its defaults)."""
    dyn, st = iter(dyn), iter(static)
    values = {}
    for i, p in enumerate(self.params):
      value = next(st) if i in self.static_pos else next(dyn)
      if value is not OMITTED:
        values[p.name] = value
    if self.kw_static:
      name = self.params[self.var_kw].name
      extra = dict(values.get(name, {}))
      for k in self.kw_static:
        value = next(st)
        if value is not OMITTED:
          extra[k] = value
      values[name] = extra
    return call_in_order(self.params, values)

  def flat_fun(self, static, treedef, scalars: bool = False):
    """``fun`` as a function of the flat dynamic leaves, returning a flat list (its output
    tree lands in ``flat_fun.out_tree`` when traced)."""
    fun = self.fun

    def flat_fun(*leaves):
      args, kwargs = self.call_args(static, tree_unflatten(treedef, leaves))
      out_leaves, flat_fun.out_tree = static_outputs(fun(*args, **kwargs), scalars)
      return out_leaves  # a flat list, so executables return flat lists too

    flat_fun.__name__ = self.name
    flat_fun.out_tree = None
    return flat_fun

  def leaf_paths(self, dyn) -> list[str]:
    """Keypaths of the flat leaves, in parameter order, e.g. ``"batch['mask']"``."""
    return [name + jax.tree_util.keystr(p)
            for name, value in zip(self.dyn_names, dyn, strict=True)
            for p, _ in jax.tree_util.tree_flatten_with_path(value, is_leaf=is_padded)[0]]

  def leaf_specs(self, dims, dyn) -> list[str | None]:
    """The dims spec text of each flat leaf (None: no dims) from the ``dims`` option."""
    texts: list[str | None] = []
    for name, value in zip(self.dyn_names, dyn, strict=True):
      n_leaves = len(tree_flatten(value, is_leaf=is_padded)[0])
      spec = dims.get(name)
      if spec is None or n_leaves == 0:  # no dims, or nothing to pad (None, left out)
        texts.extend([None] * n_leaves)
      elif isinstance(spec, str):
        if n_leaves != 1:
          raise SpecError(f"dims[{name!r}] = {spec!r} is one spec, but argument {name!r} is a "
                          f"pytree with {n_leaves} leaves; give a pytree of specs matching it")
        texts.append(spec)
      elif (n_leaves == 1 and isinstance(spec, list | tuple) and spec
            and all(isinstance(s, str) for s in spec)
            and jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(
                value, is_leaf=is_padded))):
        raise SpecError(f"dims[{name!r}] = {spec!r} is a list, but argument {name!r} is one "
                        f"array; write its axes as one spec string: "
                        f"dims={{{name!r}: {', '.join(spec)!r}}}")
      else:
        try:  # each spec's texts in a _Texts (a pytree leaf): a list of specs is a node
          per = jax.tree_util.tree_map(
              lambda s, sub: _Texts([s] * len(tree_flatten(sub, is_leaf=is_padded)[0])), spec,
              value, is_leaf=lambda x: x is None or isinstance(x, str))
        except ValueError as e:
          raise SpecError(f"dims[{name!r}] does not match the structure of argument {name!r}: "
                          f"{e}") from None
        texts.extend(itertools.chain.from_iterable(
            jax.tree_util.tree_leaves(per, is_leaf=lambda x: isinstance(x, _Texts))))
    return texts

  def donate_positions(self, donate: tuple[str, ...]) -> tuple[int, ...]:
    """Positions (among the dynamic arguments) of ``donate_argnames``."""
    return tuple(i for i, n in enumerate(self.dyn_names) if n in donate)


def call_in_order(params, values) -> tuple[list, dict]:
  """``(args, kwargs)`` calling ``params`` with ``values`` (name -> value) as ``jax.jit`` calls
  a function: positional parameters positionally up to the first one missing from ``values``
  (the caller left it out: not passed, its default applies), the rest by keyword; a ``*args``
  value (a tuple) extends the positional ones, a ``**kwargs`` value (a dict) the keywords."""
  args, kwargs, by_name = [], {}, False
  for p in params:
    if p.name not in values:
      by_name = True
    elif p.kind is _VAR_POS:
      args.extend(values[p.name])
    elif p.kind is _VAR_KW:
      kwargs.update(values[p.name])
    elif p.kind is inspect.Parameter.KEYWORD_ONLY or by_name:
      kwargs[p.name] = values[p.name]
    else:
      args.append(values[p.name])
  return args, kwargs


def parameters(fun) -> tuple[inspect.Parameter, ...]:
  try:
    return tuple(inspect.signature(fun).parameters.values())
  except (TypeError, ValueError):
    raise SpecError(f"dynjax.jit: cannot read the signature of {fun!r}") from None


def positional_names(params) -> list[str]:
  """The parameters a call's positions fill, in order, up to ``*args`` (``static_argnums``)."""
  return [p.name for p in itertools.takewhile(
      lambda p: p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                           inspect.Parameter.POSITIONAL_OR_KEYWORD), params)]


# -- leaves ---------------------------------------------------------------------------------
def leaf_key_of_aval(a) -> tuple:
  return (a.dtype, len(a.shape), bool(a.weak_type))


def on_device(x) -> bool:
  t = type(x)
  if t is _ARRAY_IMPL:
    return True
  if t is Padded:
    return on_device(x.buffer)
  return t is not np.ndarray and isinstance(x, jax.Array)


def canonical(dtype):
  """The dtype JAX computes in for a host value of ``dtype``: with x64 off, float64/int64
  numpy arrays run as float32/int32, as in ``jax.jit``.  Only 8-byte dtypes can change, so
  the others skip ``canonicalize_dtype`` (~0.75 us)."""
  if dtype.itemsize < 8:
    return dtype
  return jax.dtypes.canonicalize_dtype(dtype)


def leaf_key(x):
  """(dtype, rank, weak) of a leaf without building an aval (dtypes canonical, as jax.jit).

  Measured (2-core CPU): ~0.15 us for a jax array through ``.aval`` and an exact type test;
  ``isinstance(x, jax.Array)`` (an ABC check) alone cost ~0.8 us, 170 us for a 200-leaf model.
  """
  t = type(x)
  if t is _ARRAY_IMPL:
    a = x.aval
    return (a.dtype, len(a.shape), False)
  if t is np.ndarray:
    return (canonical(x.dtype), x.ndim, False)
  if t is Padded:
    return (x.buffer.dtype, len(x.shape), False)
  a = aval(x)
  return (a.dtype, len(a.shape), a.weak_type)


def reject_abstract(name: str, binder: Binder, dyn) -> None:
  """Raises a SpecError naming the first ``jax.ShapeDtypeStruct`` among a call's arguments
  (they describe arguments for ``trace``/``lower``/``warmup``; a call needs arrays).  Run only
  after a call failed, so it costs the hot path nothing."""
  leaves = tree_flatten(dyn, is_leaf=is_padded)[0]
  for path, x in zip(binder.leaf_paths(dyn), leaves, strict=True):
    if type(x) is jax.ShapeDtypeStruct:
      raise SpecError(
          f"{name}(): argument {path} is a jax.ShapeDtypeStruct{tuple(x.shape)} "
          f"{x.dtype}, but a call needs an array. Abstract arguments describe "
          f"shapes for {name}.lower(...), .trace(...) and .warmup(...) (e.g. a warmup at start-up "
          "before the weights exist); pass arrays to call it.")


def is_key(x) -> bool:
  """A jax array (or abstract value) of an extended dtype (``jax.random.key``): it has no
  numpy form."""
  dtype = getattr(x, "dtype", None)
  return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def aval(x) -> jax.ShapeDtypeStruct:
  """The abstract value a leaf is traced with (numpy dtypes canonicalised, as jax.jit)."""
  if is_padded(x):
    return jax.ShapeDtypeStruct(x.shape, canonical(np.dtype(x.buffer.dtype)))
  if isinstance(x, np.ndarray):
    return jax.ShapeDtypeStruct(x.shape, canonical(x.dtype))
  if type(x) is jax.ShapeDtypeStruct:  # trace/lower/warmup with abstract arguments (as jax.jit)
    if is_key(x):  # a PRNG key: not a numpy dtype
      return x
    return jax.ShapeDtypeStruct(x.shape, canonical(np.dtype(x.dtype)), weak_type=x.weak_type)
  if isinstance(x, jax.Array):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)
  if isinstance(x, bool | int | float | complex):  # weakly typed, as jax.jit traces them
    kind = bool if isinstance(x, bool) else int if isinstance(x, int) else (
        float if isinstance(x, float) else complex)
    return jax.ShapeDtypeStruct((), canonical(np.dtype(kind)), weak_type=True)
  if isinstance(x, np.generic):
    return jax.ShapeDtypeStruct((), canonical(x.dtype))
  try:
    a = jnp.asarray(x)
  except (TypeError, ValueError):
    raise SpecError(f"argument leaf of type {type(x).__name__} is not an array; mark its "
                    "parameter in static_argnames") from None
  return jax.ShapeDtypeStruct(a.shape, a.dtype)


# -- dims="auto" ----------------------------------------------------------------------------
def auto_fits(state, shapes) -> bool:
  for entry, shape in zip(state, shapes, strict=True):
    for d, n in zip(entry, shape, strict=True):
      if isinstance(d, int) and d != n:
        return False
  return True


def auto_promote(state, shapes):
  """Makes every axis whose size changed symbolic; axes that changed together share a name."""
  if state is None:
    return [tuple(int(n) for n in s) for s in shapes]
  used = {d for entry in state for d in entry if isinstance(d, str)}
  groups: dict[tuple[int, int], str] = {}
  new_state = []
  counter = itertools.count()
  for entry, shape in zip(state, shapes, strict=True):
    row = []
    for d, n in zip(entry, shape, strict=True):
      if isinstance(d, int) and d != n:
        name = groups.get((d, n))
        if name is None:
          name = next(f"d{i}" for i in counter if f"d{i}" not in used)
          used.add(name)
          groups[(d, n)] = name
        row.append(name)
      else:
        row.append(d)
    new_state.append(tuple(row))
  return new_state


def auto_specs(state) -> list[str | None]:
  out = []
  for entry in state:
    if any(isinstance(d, str) for d in entry):
      out.append(", ".join(str(d) for d in entry))
    else:
      out.append(None)
  return out


def is_signature_error(e: BaseException) -> bool:
  """An executable rejected its arguments (new parameter shapes/dtypes/structure): retrace."""
  msg = str(e)
  return msg.startswith("Argument types differ") or msg.startswith(
      "Function compiled with input pytree does not match")
