"""Stage objects of ``dynjax.jit``: thin views over a family (after ``jax/_src/stages.py``).

``Wrapped.trace(*args)`` -> :class:`Traced` (the symbolic jaxpr and shape functions of the
arguments' family) -> ``.lower(bucket)`` -> :class:`Lowered` (one bucket's padded function
as StableHLO) -> ``.compile()`` -> :class:`Compiled` (that bucket's XLA executable; calling
it runs arguments of that bucket through the same run routine as ``Wrapped.__call__``).
"""

from __future__ import annotations

from collections.abc import Mapping

from dynjax import _symbolic
from dynjax._errors import ShapeMismatchError, SpecError
from dynjax.jit._args import is_padded, on_device, tree_flatten, tree_unflatten
from dynjax.jit._family import PADDED_MODES, Family


class Traced:
  """A function traced with symbolic dims: the symbolic jaxpr and its shape functions."""

  __slots__ = ("dispatcher", "family", "sizes")

  def __init__(self, dispatcher, family: Family, sizes):
    self.dispatcher = dispatcher
    self.family = family
    self.sizes = tuple(sizes)

  @property
  def name(self) -> str:
    return self.dispatcher.name

  @property
  def jaxpr(self):
    """The symbolic ``ClosedJaxpr`` (None when tracing failed and the function runs exact)."""
    return self.family.jaxpr

  @property
  def dim_vars(self) -> tuple[str, ...]:
    return self.family.sig.var_order

  @property
  def out_shapes(self):
    """Symbolic output shapes, as a pytree of ``ShapeDtypeStruct``."""
    fam = self.family
    return None if fam.out_tree is None else tree_unflatten(fam.out_tree, list(fam.out_avals))

  def bucket(self) -> tuple[int, ...] | None:
    """The bucket a call with these arguments runs on (the policies, the joint plan and
    ``overflow`` decide, as for a call), or None: it runs exact."""
    if not self.family.sig.var_order:
      return ()
    return self.family.bucket_of(self.sizes, observe=False)

  def lower(self, bucket: Mapping[str, int] | None = None) -> Lowered:
    """Lowers the executable of ``bucket`` (default: the bucket of the traced arguments)."""
    fam = self.family
    if fam.mode not in PADDED_MODES:
      raise SpecError(f"{self.name} runs {fam.mode} (unpadded), so it has no bucket "
                      f"executables to lower: {fam.fallback or 'padding=' + repr(fam.mode)}")
    if bucket is None:
      bkey = self.bucket()
      if bkey is None:
        raise SpecError(f"{self.name}: sizes {dict(zip(self.dim_vars, self.sizes, strict=True))} run "
                        "exact (unpadded) under overflow='exact'; pass bucket= to lower one")
    else:
      missing = [v for v in fam.sig.var_order if v not in bucket]
      if missing:
        raise SpecError(f"lower(bucket=...): give a size for every dimension variable; "
                        f"missing {missing} of {list(fam.sig.var_order)}")
      bkey = tuple(int(bucket[v]) for v in fam.sig.var_order)
    lowered, rewrites = fam.lower_bucket(bkey)
    return Lowered(self, bkey, lowered, rewrites)

  def as_text(self) -> str:
    return str(self.family.jaxpr)

  def __repr__(self) -> str:
    return f"Traced({self.name}, dims={self.dim_vars}, sizes={self.sizes})"


class Lowered:
  """One bucket's padded function, lowered to StableHLO."""

  __slots__ = ("traced", "bucket", "_lowered", "rewrites")

  def __init__(self, traced: Traced, bucket, lowered, rewrites):
    self.traced = traced
    self.bucket = bucket
    self._lowered = lowered
    self.rewrites = rewrites

  def as_text(self) -> str:
    return self._lowered.as_text()

  def compile(self) -> Compiled:
    """Compiles the bucket; the executable also joins the function's cache."""
    fam = self.traced.family
    entry = fam.entry_of(self._lowered.compile(), self.bucket, self.rewrites)
    d = self.traced.dispatcher
    entry = d.cache.get_or_build((fam.fid, self.bucket), lambda: entry)
    if self.bucket not in fam.buckets:
      fam.buckets[self.bucket] = entry
      fam.gen += 1
    return Compiled(self.traced, self.bucket, entry)

  def __repr__(self) -> str:
    return f"Lowered({self.traced.name}, bucket={self.bucket})"


class Compiled:
  """One bucket's XLA executable; calling it pads, runs and unpads arguments that fit the
  bucket (a ``ShapeMismatchError`` names the bucket they need otherwise)."""

  __slots__ = ("traced", "bucket", "entry")

  def __init__(self, traced: Traced, bucket, entry):
    self.traced = traced
    self.bucket = bucket
    self.entry = entry

  def as_text(self) -> str:
    return self.entry.exe.as_text()

  def __call__(self, *args, **kwargs):
    from dynjax.jit._dispatch import Executor

    d = self.traced.dispatcher
    static, dyn = d.binder.split(args, kwargs)
    traced = trace(d, static, dyn)
    fam = traced.family
    if fam is not self.traced.family:
      raise ShapeMismatchError(
          f"{d.name}: these arguments have another static signature (dtypes, ranks, static "
          "arguments or pytree structure) than the traced ones; call the dynjax function "
          "itself to dispatch them")
    need = traced.bucket()  # None: these sizes run exact (overflow, or outside a guard)
    if need is None or any(n > b for n, b in zip(traced.sizes, self.bucket, strict=True)):
      raise ShapeMismatchError(
          f"these arguments need bucket {need} but this executable is bucket "
          f"{self.bucket}; call the dynjax function itself to dispatch any shape")
    leaves = d.arg_leaves(fam, tree_flatten(dyn, is_leaf=is_padded)[0])
    shapes = {i: getattr(leaves[i], "shape", ()) for i in fam.spec_idx}
    own, out_shapes, true_elems = fam.size_info(traced.sizes, observe=False)
    device = any(on_device(leaves[i]) for i in fam.spec_idx)
    padded_in = any(is_padded(leaves[i]) for i in fam.spec_idx)
    dev_sizes = d.sizes_vector(fam, traced.sizes) if fam.mode == "auto" else None
    ex = Executor(d, fam, traced.sizes, own, self.bucket, self.entry, shapes, device, False,
                  dev_sizes, out_shapes, true_elems, padded_in)
    ex.once = True  # counted as its call ends (not kept)
    return ex.run(leaves)

  def __repr__(self) -> str:
    return f"Compiled({self.traced.name}, bucket={self.bucket})"


def trace(d, static, dyn) -> Traced:
  """The Traced of a call's arguments (their family, traced once, and true sizes)."""
  leaves, treedef = tree_flatten(dyn, is_leaf=is_padded)
  fam = d.family(static, dyn, leaves, treedef)
  shapes = [x.shape if hasattr(x, "shape") else () for x in d.arg_leaves(fam, leaves)]
  sizes = _symbolic.solve_sizes(fam.sig, shapes) if fam.sig.var_order else ()
  return Traced(d, fam, sizes)
