"""Sharding for ``dynjax.jit``: bucketed executables on a device mesh, with JAX's own GSPMD.

Nothing here partitions anything by hand: every bucket is a ``jax.jit(..., in_shardings=...,
out_shardings=...)`` lowering, so XLA's SPMD partitioner inserts the collectives, exactly as
for a user's own ``jax.jit``.  This module only

* validates ``in_shardings``/``out_shardings`` and resolves them, per family, to one
  ``NamedSharding`` per flat argument leaf and per flat output (:func:`check_options`,
  :func:`resolve`);
* makes bucket sizes of sharded dimensions multiples of the mesh axis size: a dimension
  variable that appears on an axis sharded over ``n`` devices gets ``policy.aligned(n)``;
* checks that static dimensions are divisible, and that every mesh axis name exists
  (:class:`dynjax.ShardingError`, listing every problem with its argument keypath);
* places padded host inputs with their sharding straight from the host
  (``jax.device_put(buffer, sharding)``: each device receives only its shard, there is no
  gather onto one device), reshards device inputs on device, and pads inputs of a
  multi-process run shard by shard (:meth:`FamilyShardings.pad`);
* unpads device outputs while keeping them sharded (:meth:`FamilyShardings.unpad`).

Accepted forms (as ``jax.jit``; a ``PartitionSpec`` needs a mesh, taken from the
``NamedSharding`` values given or else from the mesh context, ``with jax.set_mesh(mesh):``):

* one ``NamedSharding`` / ``PartitionSpec`` / ``None`` for every argument leaf;
* a tuple/list with one entry per non-static parameter, in order, each a pytree prefix of
  that argument;
* a dict: parameter name -> pytree prefix (parameters left out are replicated).

``None`` (or a parameter left out) means *replicated over the mesh* for inputs, and
*let GSPMD choose* for outputs.  ``out_shardings`` is one sharding for every output or a
pytree prefix of the function's output.

Multi-process (``jax.distributed``): build the mesh over ``jax.devices()`` (all processes),
let each process make its part of every input with ``jax.make_array_from_process_local_data``
and call the function with those global arrays; use ``return_padded=True`` (or read
``.addressable_shards`` of the outputs).  Axes sharded across processes must already have a
bucket size (e.g. a fixed per-process batch); other dynamic axes are padded shard by shard on
each process.  See WORKSPACE.md, "Sharding", and tests/jit/test_sharding.py.

Example:
  >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
  >>> f = dynjax.jit(layer, dims={"x": "b, t, 64"},
  ...                in_shardings={"x": NamedSharding(mesh, P("data")),
  ...                              "w": NamedSharding(mesh, P(None, "model"))})
  >>> f(x, w)          # b is bucketed to multiples of 2 (the "data" axis)
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from dynjax import _symbolic
from dynjax._errors import ShardingError, format_list
from dynjax._padded import Padded

_FORMS = ("a jax.sharding.NamedSharding, a PartitionSpec or None; a tuple with one such pytree "
          "prefix per non-static parameter; or a dict parameter name -> pytree prefix")


def _is_leaf(x) -> bool:
  return x is None or isinstance(x, Sharding | PartitionSpec)


def _check_leaves(tree, what: str) -> None:
  bad = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_leaf)[0]:
    if leaf is None or isinstance(leaf, NamedSharding | PartitionSpec):
      continue
    bad.append(f"{what}{jax.tree_util.keystr(path)}: {type(leaf).__name__} {leaf!r}")
  if bad:
    raise ShardingError(
        "unsupported sharding value(s):\n" + format_list(bad)
        + "\nUse jax.sharding.NamedSharding(mesh, PartitionSpec(...)), a PartitionSpec (with a "
        "mesh from `with jax.set_mesh(mesh):`), or None.")


@dataclasses.dataclass(frozen=True)
class ShardingOptions:
  """Validated ``in_shardings``/``out_shardings`` of one ``dynjax.jit`` function."""

  inputs: Any  # dict parameter name -> prefix, or a single prefix for every leaf ("*")
  outputs: Any  # a pytree prefix of the output (None: GSPMD chooses)
  given_out: bool


def check_options(in_shardings, out_shardings, dyn_names: Sequence[str],
                  static_names: Sequence[str], fun_name: str) -> ShardingOptions | None:
  """Validates the two options at ``dynjax.jit`` time; None when neither is given."""
  if in_shardings is None and out_shardings is None:
    return None
  if isinstance(in_shardings, Mapping):
    unknown = [k for k in in_shardings if k not in dyn_names]
    if unknown:
      static = [k for k in unknown if k in static_names]
      why = (f"{static} are in static_argnames (static arguments are not sharded)" if static
             else f"{unknown} are not parameters of {fun_name}")
      raise ShardingError(f"in_shardings names {unknown}: {why}; its non-static parameters are "
                          f"{list(dyn_names)}")
    inputs = dict(in_shardings)
  elif isinstance(in_shardings, tuple | list):
    if len(in_shardings) != len(dyn_names):
      raise ShardingError(
          f"in_shardings has {len(in_shardings)} entries but {fun_name} has "
          f"{len(dyn_names)} non-static parameters {list(dyn_names)}; give one entry (a pytree "
          "prefix, None for replicated) per parameter, or a dict by parameter name")
    inputs = dict(zip(dyn_names, in_shardings, strict=True))
  elif _is_leaf(in_shardings):
    inputs = {n: in_shardings for n in dyn_names}
  else:
    raise ShardingError(f"in_shardings: expected {_FORMS}; got {type(in_shardings).__name__}")
  _check_leaves(inputs, "in_shardings")
  _check_leaves(out_shardings, "out_shardings")
  return ShardingOptions(inputs, out_shardings, out_shardings is not None)


def context_mesh():
  """The concrete mesh of ``with jax.set_mesh(mesh):`` (or ``jax.sharding.use_mesh``), or None.

  ``jax.sharding.get_mesh`` exists in jax 0.10 and 0.11; older versions have no context.
  """
  get = getattr(jax.sharding, "get_mesh", None)
  if get is None:
    return None
  try:
    mesh = get()
  except Exception:  # noqa: BLE001 - no concrete mesh in this context
    return None
  if mesh is None or getattr(mesh, "empty", False) or not getattr(mesh, "shape", None):
    return None
  return mesh


def _axis_size(mesh, entry) -> int:
  if entry is None or entry is PartitionSpec.UNCONSTRAINED:
    return 1
  names = entry if isinstance(entry, tuple) else (entry,)
  return math.prod(mesh.shape[n] for n in names)


def _axis_names(entry) -> tuple:
  if entry is None or entry is PartitionSpec.UNCONSTRAINED:
    return ()
  return entry if isinstance(entry, tuple) else (entry,)


def _fit(sharding: NamedSharding, shape) -> NamedSharding:
  """``sharding`` with the axes that do not divide ``shape`` replicated (exact shapes)."""
  spec = tuple(sharding.spec)
  keep = tuple(e if i < len(shape) and shape[i] % _axis_size(sharding.mesh, e) == 0 else None
               for i, e in enumerate(spec))
  if keep == spec:
    return sharding
  return NamedSharding(sharding.mesh, PartitionSpec(*keep))


@dataclasses.dataclass
class FamilyShardings:
  """The resolved shardings of one family (one static signature)."""

  mesh: Any
  inputs: tuple[NamedSharding, ...]  # one per flat argument leaf
  outputs: tuple[NamedSharding | None, ...] | None  # one per flat output; None: GSPMD chooses
  multiples: dict[str, int]  # dimension variable -> bucket multiple
  replicated: NamedSharding
  fully_addressable: bool
  options: ShardingOptions  # what the user gave (output shardings of exact executables)
  name: str  # the function's name, for messages

  # -- lowering ----------------------------------------------------------------------------
  def jit_kwargs(self, fam, bkey, sizes_first: bool) -> dict:
    """``in_shardings``/``out_shardings`` for ``jax.jit`` of one bucket's padded function."""
    self._check_bucket(fam, bkey)
    ins = tuple(self.inputs)
    if sizes_first:
      ins = (self.replicated, *ins)  # the int32 vector of true sizes (padding="auto")
    kw: dict[str, Any] = {"in_shardings": ins}
    if self.outputs is not None:
      kw["out_shardings"] = list(self.outputs)
    return kw

  def exact_kwargs(self, fam, avals) -> dict:
    """Shardings for the exact-shape executable: axes a true size does not divide replicate."""
    kw: dict[str, Any] = {"in_shardings": tuple(
        _fit(s, a.shape) for s, a in zip(self.inputs, avals, strict=True))}
    if self.options.given_out:
      outs = jax.eval_shape(fam.flat_fun, *avals)  # also sets flat_fun.out_tree
      flat = self.outputs
      if flat is None or len(flat) != len(outs):
        flat = _resolve_outputs(self.options, self.mesh, fam.flat_fun.out_tree)
      kw["out_shardings"] = [None if s is None else _fit(s, o.shape)
                             for s, o in zip(flat, outs, strict=True)]
    return kw

  def _check_bucket(self, fam, bkey) -> None:
    """Compound dims (``2*t``, ``t+1``) are checked per bucket: alignment cannot promise them."""
    problems = []
    for path, shape, sh in zip(fam.leaf_paths, (a.shape for a in fam.padded_avals(bkey)),
                               self.inputs, strict=True):
      problems += _divisibility(f"argument {path}", shape, sh)
    if self.outputs is not None and fam.out_avals is not None:
      for i, (fn, sh) in enumerate(zip(fam.out_shape_fns, self.outputs, strict=True)):
        if sh is not None:
          problems += _divisibility(f"output {i}", fn(bkey), sh)
    if problems:
      env = ", ".join(f"{v}={n}" for v, n in zip(fam.sig.var_order, bkey, strict=True))
      raise ShardingError(
          f"{self.name}: at bucket ({env}) the padded shapes do not divide over "
          "the mesh:\n" + format_list(problems)
          + "\nShard only axes whose dims are plain dimension variables or static multiples "
          "of the mesh axis size, or choose buckets that are.")

  # -- placing inputs ----------------------------------------------------------------------
  def put_sizes(self, sizes) -> jax.Array:
    """The int32 vector of true sizes (padding="auto"), replicated over the mesh."""
    host = np.asarray(sizes, np.int32)
    if self.fully_addressable:
      return _put(host, self.replicated)
    return jax.make_array_from_process_local_data(self.replicated, host)

  def pad(self, fam, leaves, shapes, in_shapes, zero: bool) -> list:
    """Pads and places every argument leaf with its sharding (replaces the host padder).

    Host leaves: one padded numpy buffer, then ``jax.device_put(buffer, sharding)``: each
    device receives only its own shard (no gather onto one device). ``may_alias=False``
    because the CPU client would otherwise alias the numpy buffer.
    """
    out = []
    for i, (x, shape, target, sh) in enumerate(
        zip(leaves, shapes, in_shapes, self.inputs, strict=True)):
      if type(x) is Padded:
        if tuple(x.buffer.shape) == target:
          x, shape = x.buffer, target
        elif isinstance(x.buffer, jax.Array) and not x.buffer.is_fully_addressable:
          x = x.buffer  # pad shard by shard below; the true shape is checked there
        else:
          x = x.unpad()
          shape = x.shape
      if isinstance(x, jax.Array):
        if shape == target:
          out.append(x if x.sharding == sh else jax.device_put(x, sh))  # on-device reshard
          continue
        if not x.is_fully_addressable:
          out.append(_pad_shards(x, target, sh, fam.leaf_paths[i]))
          continue
        # A fully addressable device array of a non-bucket shape: gathered, padded and
        # scattered through the host, or padded in place once its shape has paid for a
        # program (jit/_devpad.py).
        site = fam.ctx.devpads.site("pad", shape, target, x.dtype, x.sharding, sh)
        out.append(_host_pad(x, shape, target, sh, zero) if site is None else
                   site.run(x, _host_pad, shape, target, sh, zero))
        continue
      out.append(_host_pad(x, shape, target, sh, zero))
    return out

  # -- outputs -----------------------------------------------------------------------------
  def unpad(self, o, shape, sites=None):
    """The exact-shape prefix of a padded device output, still sharded where it divides:
    through the host, or in place once the shape has paid for a program (``sites``, the
    function's ``jit/_devpad.Sites``)."""
    if not o.is_fully_addressable:
      return _unpad_shards(o, shape)
    fit = _fit(o.sharding, shape)
    site = None if sites is None else sites.site("cut", o.shape, shape, o.dtype, o.sharding,
                                                 fit)
    return _host_cut(o, shape, fit) if site is None else site.run(o, _host_cut, shape, fit)


def _host_pad(x, shape, target, sh, zero: bool):
  """One leaf padded on the host and placed with ``sh``: each device receives only its own
  shard (no gather onto one device)."""
  x = x if isinstance(x, np.ndarray) else np.asarray(x)
  if shape != target:
    buf = np.zeros(target, x.dtype) if zero else np.empty(target, x.dtype)
    if not zero:
      _zero_tail(buf, shape)
    buf[tuple(slice(0, n) for n in shape)] = x
    x = buf
  return _put(x, sh)


def _host_cut(o, shape, fit):
  return _put(np.asarray(o)[tuple(slice(0, n) for n in shape)], fit)


def _may_alias_supported() -> bool:
  try:
    return "may_alias" in inspect.signature(jax.device_put).parameters
  except (TypeError, ValueError):  # pragma: no cover
    return False


_MAY_ALIAS = _may_alias_supported()


def _put(x, where):
  """``jax.device_put`` that never aliases a numpy buffer: the CPU client would otherwise
  share the (reused, or the caller's) host memory with the device array."""
  if _MAY_ALIAS:
    return jax.device_put(x, where, may_alias=False)
  return jax.device_put(np.array(x, copy=True) if isinstance(x, np.ndarray) else x, where)


def _zero_tail(buf: np.ndarray, shape) -> None:
  # np.empty is ~free, but stale memory must not leak NaNs/Infs into reductions that the padding
  # pass masks with multiplications; zero only the padded tail (cheaper than a full fill).
  for ax, n in enumerate(shape):
    if n < buf.shape[ax]:
      idx = [slice(None)] * buf.ndim
      idx[ax] = slice(n, None)
      buf[tuple(idx)] = 0


def _divisibility(where: str, shape, sh: NamedSharding) -> list[str]:
  out = []
  for ax, entry in enumerate(tuple(sh.spec)):
    n = _axis_size(sh.mesh, entry)
    if n > 1 and ax < len(shape) and shape[ax] % n:
      out.append(f"{where}: axis {ax} has padded size {shape[ax]}, not a multiple of mesh "
                 f"axis {entry!r} (size {n})")
  return out


def _full_spec(sh, ndim: int) -> tuple:
  spec = tuple(getattr(sh, "spec", ()))
  return spec + (None,) * (ndim - len(spec))


def _pad_shards(x: jax.Array, target, sh: NamedSharding, path: str) -> jax.Array:
  """Pads a global array that this process only partly holds, shard by shard, on the host.

  Only unsharded axes can grow: a sharded axis would need rows moved between devices
  (other processes' devices, too), which is not a local operation.
  """
  bad = [f"axis {ax}: size {x.shape[ax]}, bucket {target[ax]}"
         for ax, entry in enumerate(tuple(sh.spec))
         if ax < len(target) and _axis_size(sh.mesh, entry) > 1 and x.shape[ax] != target[ax]]
  if bad or not x.sharding.is_equivalent_to(_fit(sh, x.shape), x.ndim):
    why = (format_list(bad) if bad else
           f"  it is sharded as {x.sharding.spec}, the function expects {sh.spec}")
    raise ShardingError(
        f"argument {path} is a multi-process array (this process holds only part of it) that "
        f"must be padded from {tuple(x.shape)} to the bucket {tuple(target)}:\n{why}\n"
        "A sharded axis cannot be padded locally: feed sharded axes at a bucket size (e.g. a "
        "fixed per-process batch, padded by each process), sharded as in_shardings says.")
  arrays = []
  for s in x.addressable_shards:
    data = np.asarray(s.data)
    block = tuple(d if _axis_size(sh.mesh, e) > 1 else t for d, t, e in
                  zip(data.shape, target, _full_spec(sh, len(target)), strict=True))
    buf = np.zeros(block, data.dtype)
    buf[tuple(slice(0, n) for n in data.shape)] = data
    arrays.append(_put(buf, s.device))
  return jax.make_array_from_single_device_arrays(tuple(target), sh, arrays)


def _unpad_shards(o: jax.Array, shape) -> jax.Array:
  sh = o.sharding
  spec = _full_spec(sh, o.ndim)
  bad = [ax for ax, e in enumerate(spec)
         if _axis_size(sh.mesh, e) > 1 and o.shape[ax] != shape[ax]]
  if bad:
    raise ShardingError(
        f"a multi-process output of padded shape {tuple(o.shape)} must be cut to {tuple(shape)} "
        f"along sharded axes {bad}, which is not a local operation; pass return_padded=True "
        "and read each process's valid rows from the dynjax.Padded buffer")
  arrays = []
  for s in o.addressable_shards:
    data = np.asarray(s.data)
    cut = tuple(slice(0, d if _axis_size(sh.mesh, e) > 1 else n)
                for d, n, e in zip(data.shape, shape, spec, strict=True))
    arrays.append(_put(np.ascontiguousarray(data[cut]), s.device))
  return jax.make_array_from_single_device_arrays(tuple(shape), sh, arrays)


# -----------------------------------------------------------------------------------------------
# Resolution, per family
# -----------------------------------------------------------------------------------------------
def _family_mesh(opts: ShardingOptions, fun_name: str):
  meshes = []
  for leaf in jax.tree_util.tree_leaves((opts.inputs, opts.outputs), is_leaf=_is_leaf):
    if isinstance(leaf, NamedSharding) and all(leaf.mesh != m for m in meshes):
      meshes.append(leaf.mesh)
  if len(meshes) > 1:
    raise ShardingError(
        f"{fun_name}: in_shardings/out_shardings use {len(meshes)} different meshes "
        f"({', '.join(str(dict(m.shape)) for m in meshes)}); one function runs on one mesh")
  if meshes:
    return meshes[0]
  mesh = context_mesh()
  if mesh is None:
    raise ShardingError(
        f"{fun_name}: in_shardings/out_shardings are PartitionSpecs but there is no mesh: "
        "call the function under `with jax.set_mesh(mesh):` or give "
        "NamedSharding(mesh, spec) values")
  return mesh


def _to_named(leaf, mesh, where: str, problems: list[str]) -> NamedSharding | None:
  if leaf is None:
    return None
  spec = leaf.spec if isinstance(leaf, NamedSharding) else leaf
  unknown = [a for e in tuple(spec) for a in _axis_names(e) if a not in mesh.shape]
  if unknown:
    problems.append(f"{where}: {spec} names mesh axes {unknown}, which the mesh does not have; "
                    f"its axes are {dict(mesh.shape)}")
    return None
  return leaf if isinstance(leaf, NamedSharding) else NamedSharding(mesh, spec)


def _broadcast_prefix(prefix, value, where: str) -> list:
  """One entry per leaf of ``value`` (flattened as the core flattens arguments)."""
  def count(sub):
    return len(jax.tree_util.tree_leaves(sub, is_leaf=lambda v: type(v) is Padded))

  if _is_leaf(prefix):
    return [prefix] * count(value)
  try:
    per = jax.tree_util.tree_map(lambda s, sub: [s] * count(sub), prefix, value,
                                 is_leaf=_is_leaf)
  except ValueError as e:
    raise ShardingError(f"{where} is not a pytree prefix of the argument: {e}") from None
  return [s for group in jax.tree_util.tree_leaves(per, is_leaf=lambda v: isinstance(v, list))
          for s in group]


def _resolve_outputs(opts: ShardingOptions, mesh, out_tree):
  if not opts.given_out:
    return None
  placeholder = jax.tree_util.tree_unflatten(out_tree, [0] * out_tree.num_leaves)
  flat = _broadcast_prefix(opts.outputs, placeholder, "out_shardings")
  problems: list[str] = []
  out = tuple(_to_named(s, mesh, f"out_shardings (output {i})", problems)
              for i, s in enumerate(flat))
  if problems:
    raise ShardingError("out_shardings do not fit the mesh:\n" + format_list(problems)
                        + "\nUse axis names of the mesh, or None.")
  return out


def _check_axes(where: str, sh: NamedSharding, dims, multiples: dict, problems: list,
                drop_static: bool) -> NamedSharding:
  """Aligns the variables of sharded symbolic dims; checks (or, for dims="auto", replicates)
  sharded static dims."""
  spec = tuple(sh.spec)
  if len(spec) > len(dims):
    problems.append(f"{where}: {sh.spec} has {len(spec)} entries but rank is {len(dims)}")
    return NamedSharding(sh.mesh, PartitionSpec())
  keep = list(spec)
  for ax, entry in enumerate(spec):
    n = _axis_size(sh.mesh, entry)
    if n == 1:
      continue
    d = dims[ax]
    if _symbolic.is_symbolic(d):
      for v in _symbolic.dim_vars_of(d):
        multiples[v] = math.lcm(multiples.get(v, 1), n)
    elif int(d) % n:
      if drop_static:
        keep[ax] = None
      else:
        problems.append(f"{where}: axis {ax} has static size {int(d)}, which mesh axis "
                        f"{entry!r} (size {n}) does not divide")
  return sh if keep == list(spec) else NamedSharding(sh.mesh, PartitionSpec(*keep))


def resolve(opts: ShardingOptions | None, fam, name: str, dyn_names: Sequence[str],
            dims_auto: bool) -> FamilyShardings | None:
  """The shardings of a new family (None without ``in_shardings``/``out_shardings``).

  Asked once per family, after tracing (output shardings need the output tree).  The
  result's ``multiples`` (dimension variable -> bucket multiple) tell the family how to align
  its bucket policies; nothing here changes the family.
  """
  if opts is None:
    return None
  mesh = _family_mesh(opts, name)
  dyn = jax.tree_util.tree_unflatten(fam.treedef, list(fam.avals))
  flat: list = []
  for arg, value in zip(dyn_names, dyn, strict=True):
    flat += _broadcast_prefix(opts.inputs.get(arg), value, f"in_shardings[{arg!r}]")
  problems: list[str] = []
  replicated = NamedSharding(mesh, PartitionSpec())
  multiples: dict[str, int] = {}
  inputs = []
  for li, (leaf, aval, path) in enumerate(zip(flat, fam.avals, fam.leaf_paths, strict=True)):
    where = f"in_shardings for argument {path}"
    sh = _to_named(leaf, mesh, where, problems) or replicated
    spec = fam.sig.leaves[li]
    dims = spec.dims if spec is not None else aval.shape
    # dims="auto": static axes may become dynamic later, so they replicate instead of failing.
    inputs.append(_check_axes(where, sh, dims, multiples, problems, dims_auto))
  outputs = None
  if fam.out_tree is not None:
    outputs = _resolve_outputs(opts, mesh, fam.out_tree)
    if outputs is not None:
      outputs = tuple(
          None if sh is None else _check_axes(f"out_shardings for output {i}", sh, o.shape,
                                              multiples, problems, False)
          for i, (sh, o) in enumerate(zip(outputs, fam.out_avals, strict=True)))
  if problems:
    raise ShardingError(
        f"{name}: the shardings do not fit the arguments or the mesh:\n"
        + format_list(problems)
        + "\nFix: use axis names of the mesh; shard only axes whose static size is a multiple "
        "of the mesh axis size (dynamic dims are bucketed to multiples of it), or replicate "
        "them (None in the PartitionSpec).")
  return FamilyShardings(mesh, tuple(inputs), outputs, multiples, replicated,
                         bool(replicated.is_fully_addressable), opts, name)


def jit_kwargs(fam, bkey, sizes_first: bool) -> dict:
  """Extra ``jax.jit`` arguments of one bucket's lowering ({} without shardings)."""
  return {} if fam.shard is None else fam.shard.jit_kwargs(fam, bkey, sizes_first)


def exact_kwargs(fam, avals) -> dict:
  """Extra ``jax.jit`` arguments of an exact-shape lowering ({} without shardings)."""
  return {} if fam.shard is None else fam.shard.exact_kwargs(fam, avals)


def exact_call(compiled, fam, avals, shard: FamilyShardings):
  """Wraps an exact-shape executable so that its arguments are placed with its shardings."""
  ins = [_fit(s, a.shape) for s, a in zip(shard.inputs, avals, strict=True)]

  def call(*leaves):
    placed = [x if isinstance(x, jax.Array) and x.sharding == s
              else _put(x if isinstance(x, jax.Array) else np.asarray(x), s)
              for x, s in zip(leaves, ins, strict=True)]
    return compiled(*placed)

  call.compiled = compiled
  call.as_text = compiled.as_text
  return call
