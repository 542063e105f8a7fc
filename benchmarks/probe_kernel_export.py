"""Where a process's first export of issue 19's grouped kernels spends its time (cold start).

  python benchmarks/probe_kernel_export.py [--out DIR] [--tokens 1024]

Each child is a fresh process that builds the e2e's MoE layer (8 experts, k=2, d=1024,
ffn=4096, bf16, ``kernel="hopper"``) and lowers it once: the two Mosaic GPU kernels are
exported there (``route._once``, kernel directory off).  On a GPU it lowers for the device; on
a CPU for CUDA (the kernels lower without a GPU).  The child records, under cProfile, the
seconds of the whole ``lower()``, of module imports inside it, of ``compile()`` (Python
compiling a module's source to bytecode: where no ``.pyc`` is found), and of Mosaic GPU's
lowering (``lower_jaxpr_to_module``), and ``pyc_missing``: how many of the ``.py`` files
under jax's Mosaic GPU and Pallas GPU packages have no ``.pyc`` beside them.

Children (in order): ``plain`` (the environment as given); ``prefix_write`` (a fresh
``PYTHONPYCACHEPREFIX``, bytecode writing on: it compiles and writes what it imports);
``prefix`` (the same prefix, now holding that bytecode: what an installed package that ships
its ``.pyc`` files costs); ``plain`` again.  Writes DIR/probe_kernel_export.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _isolated  # noqa: E402
from benchmarks._report import write_json  # noqa: E402

PACKAGES = ("jax/experimental/mosaic/gpu", "jax/_src/pallas/mosaic_gpu",
            "jax/experimental/pallas", "jax/_src/pallas")


def pyc_missing() -> dict:
  """Per package of :data:`PACKAGES`: [.py files without a .pyc the import would find, all]."""
  import importlib.util

  import jax

  root = os.path.dirname(os.path.dirname(jax.__file__))
  out = {}
  for pkg in PACKAGES:
    d = os.path.join(root, pkg)
    files = [os.path.join(d, f) for f in os.listdir(d) if f.endswith(".py")] if os.path.isdir(
        d) else []
    out[pkg] = [sum(not os.path.exists(importlib.util.cache_from_source(f)) for f in files),
                len(files)]
  return out


def child(tokens: int) -> dict:
  import cProfile
  import pstats

  t0 = time.perf_counter()
  import jax
  import jax.numpy as jnp

  from dynjax import route
  from dynjax.route import _hopper, _once

  t_import = time.perf_counter() - t0
  gpu = jax.default_backend() == "gpu"
  if not gpu:  # lower for CUDA here: the kernels need no GPU to lower
    _hopper.unavailable_reason = lambda dtype: None
  _once.PRECOMPILE_ON = ()  # time the export, not a background compile
  moe = route.Routed(route.Experts(route.ffn()), route.Router(8, k=2), mode="grouped",
                     kernel="hopper")
  params = {"w1": jax.ShapeDtypeStruct((8, 1024, 4096), jnp.bfloat16),
            "w2": jax.ShapeDtypeStruct((8, 4096, 1024), jnp.bfloat16)}

  def lower(n):
    traced = jax.jit(moe).trace(params, jax.ShapeDtypeStruct((n, 1024), jnp.bfloat16),
                                jax.ShapeDtypeStruct((n, 8), jnp.float32))
    return traced.lower() if gpu else traced.lower(lowering_platforms=("cuda",))

  prof = cProfile.Profile()
  t1 = time.perf_counter()
  prof.enable()
  lower(tokens)
  prof.disable()
  first = time.perf_counter() - t1
  t2 = time.perf_counter()
  lower(2 * tokens)  # the same kernels: the export is reused
  second = time.perf_counter() - t2
  stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)

  def cum(pred):
    return round(sum(v[3] for k, v in stats.items() if pred(k)), 4)

  top = sorted(((v[2], f"{os.path.basename(k[0])}:{k[2]}") for k, v in stats.items()),
               reverse=True)[:12]
  return {"backend": jax.default_backend(), "jax": jax.__version__,
          "import_jax_dynjax_s": round(t_import, 4), "first_lower_s": round(first, 4),
          "second_lower_s": round(second, 4),
          # cProfile counts a recursive function's time in its outermost calls only
          "imports_s": cum(lambda k: k[2] == "_find_and_load"),
          "bytecode_compile_s": cum(lambda k: k[2] == "<built-in method builtins.compile>"),
          "bytecode_compiles": sum(v[1] for k, v in stats.items()
                                   if k[2] == "<built-in method builtins.compile>"),
          "mosaic_lowering_s": cum(lambda k: k[2] == "lower_jaxpr_to_module"
                                   and "mosaic_gpu" in k[0]),
          "pyc_missing": pyc_missing(),
          "top_self_s": [[round(t, 4), name] for t, name in top]}


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--out", default=None)
  ap.add_argument("--tokens", type=int, default=1024)
  ap.add_argument("--timeout", type=float, default=180)
  ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.child:
    _isolated.emit(child(args.tokens))
    return {}
  prefix = tempfile.mkdtemp(prefix="dynjax_pyc_")
  base = dict(os.environ, DYNJAX_KERNEL_CACHE="0")
  runs = []
  for name, env in (("plain", base),
                    ("prefix_write", {**{k: v for k, v in base.items()
                                         if k != "PYTHONDONTWRITEBYTECODE"},
                                      "PYTHONPYCACHEPREFIX": prefix}),
                    ("prefix", {**base, "PYTHONPYCACHEPREFIX": prefix}),
                    ("plain", base)):
    rec = _isolated.run([sys.executable, os.path.abspath(__file__), "--child",
                         "--tokens", str(args.tokens)], env, args.timeout)
    rec["child"] = name
    runs.append(rec)
    keys = ("first_lower_s", "imports_s", "bytecode_compile_s", "bytecode_compiles",
            "mosaic_lowering_s", "second_lower_s")
    print(name, {k: rec.get(k) for k in keys}, rec.get("error", ""), flush=True)
  print("pyc missing (plain):", runs[0].get("pyc_missing"), flush=True)
  out = {"python": sys.version.split()[0], "runs": runs}
  write_json(args.out, "probe_kernel_export.json", out)
  return out


if __name__ == "__main__":
  main()
