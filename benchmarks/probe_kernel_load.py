"""Can a kept Mosaic GPU kernel run in a process that never imported Mosaic GPU's Python?

  python benchmarks/probe_kernel_load.py --out $OUT        # GPU (Hopper) only

Step ``export`` (a fresh process): the grouped layer's GEMM 1 (``_hopper.hopper_gmm``, 8
experts, 8,192 rows, bf16) through ``route._once`` with the kernel kept in ``--dir``; its output
is saved.  Step ``load`` (a fresh process per variant): the kept file deserialized with
``jax.export`` and called, the output compared with the saved one.  Variants: ``none`` (no
Mosaic GPU import at all), ``lib`` (only ``jax._src.lib.mosaic_gpu``, the compiled bindings),
``runtime`` (``dynjax._jax_private.mosaic_gpu_runtime``: the bindings, and the runtime's path
set as ``core``'s import sets it), ``core`` (``jax.experimental.mosaic.gpu``, what the Pallas
kernel's build imports), ``dynjax`` (the kernel through ``route._once``, which finds the kept
file: whether Mosaic GPU's Python was imported at all).  Each
reports whether it ran, the seconds of its import, of the load, and of the first call (compile
included), and which Mosaic GPU modules ``sys.modules`` held before the call.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROWS, K, N, G = 8192, 1024, 4096, 8


def _inputs():
  import jax
  import jax.numpy as jnp

  from dynjax import route
  from dynjax.route import _gmm

  t = route.Tiling.auto(ROWS, G, "hopper")
  m = _gmm.buffer_rows(ROWS, G, t, "hopper")
  key = jax.random.PRNGKey(0)
  a = jax.random.normal(key, (m, K), jnp.bfloat16)
  w = (jax.random.normal(jax.random.fold_in(key, 1), (G, K, N)) * 0.03).astype(jnp.bfloat16)
  tiles = m // t.tm
  tile_end = jnp.asarray([(i + 1) * tiles // G for i in range(G)], jnp.int32)
  return t, m, a, w, tile_end


def export_step(d: str) -> dict:
  import jax
  import numpy as np

  from dynjax.route import _hopper

  os.environ["DYNJAX_KERNEL_CACHE"] = d
  t, m, a, w, tile_end = _inputs()
  t0 = time.perf_counter()
  y = jax.jit(lambda a, w, te: _hopper.hopper_gmm(a, w, te, t, jax.nn.gelu, m))(a, w, tile_end)
  y = np.asarray(y.astype("float32"))
  np.save(os.path.join(d, "want.npy"), y)
  return {"seconds": round(time.perf_counter() - t0, 3),
          "files": sorted(f for f in os.listdir(d) if f.endswith(".jaxexport"))}


def load_step(d: str, variant: str) -> dict:
  import jax
  import numpy as np
  from jax import export

  if variant == "dynjax":
    return dynjax_step(d)
  t0 = time.perf_counter()
  if variant == "lib":
    import jax._src.lib.mosaic_gpu  # noqa: F401
  elif variant == "core":
    import jax.experimental.mosaic.gpu  # noqa: F401
  elif variant == "runtime":
    from dynjax import _jax_private

    why = _jax_private.mosaic_gpu_runtime()
    if why is not None:
      return {"variant": variant, "ran": False, "error": why}
  t_import = time.perf_counter() - t0

  (name,) = [f for f in os.listdir(d) if f.endswith(".jaxexport")]
  t1 = time.perf_counter()
  with open(os.path.join(d, name), "rb") as fh:
    exp = export.deserialize(bytearray(fh.read()))
  t_load = time.perf_counter() - t1
  _, _, a, w, tile_end = _inputs()
  mods = sorted(m for m in sys.modules if "mosaic" in m and "gpu" in m)
  t2 = time.perf_counter()
  try:
    y = np.asarray(jax.jit(exp.call)(tile_end, a, w).astype("float32"))
  except Exception as e:  # noqa: BLE001 - the answer we look for
    return {"variant": variant, "ran": False, "error": f"{type(e).__name__}: {str(e)[:600]}",
            "modules_before_call": mods}
  want = np.load(os.path.join(d, "want.npy"))
  return {"variant": variant, "ran": True, "import_s": round(t_import, 3),
          "load_s": round(t_load, 4), "first_call_s": round(time.perf_counter() - t2, 3),
          "max_abs_diff": float(np.max(np.abs(y - want))), "modules_before_call": mods}


def dynjax_step(d: str) -> dict:
  """The kept kernel through dynjax itself (``route._once`` finds the file the export step
  kept): which Mosaic GPU modules the process imported, and the seconds of the first call."""
  import jax
  import numpy as np

  from dynjax.route import _hopper, _once

  os.environ["DYNJAX_KERNEL_CACHE"] = d
  before = set(os.listdir(d))
  t, m, a, w, tile_end = _inputs()
  t0 = time.perf_counter()
  try:
    y = jax.jit(lambda a, w, te: _hopper.hopper_gmm(a, w, te, t, jax.nn.gelu, m))(a, w, tile_end)
    y = np.asarray(y.astype("float32"))
  except Exception as e:  # noqa: BLE001 - the answer we look for
    return {"variant": "dynjax", "ran": False, "error": f"{type(e).__name__}: {str(e)[:600]}"}
  want = np.load(os.path.join(d, "want.npy"))
  return {"variant": "dynjax", "ran": True, "first_call_s": round(time.perf_counter() - t0, 3),
          "max_abs_diff": float(np.max(np.abs(y - want))),
          "loaded_not_exported": set(os.listdir(d)) == before,
          "exports": _once._exported.cache_info().misses,
          "runtime_path": os.environ.get("MOSAIC_GPU_RUNTIME_LIB_PATH"),
          "mosaic_python_imported": "jax.experimental.mosaic.gpu" in sys.modules,
          "pallas_mosaic_imported": "jax.experimental.pallas.mosaic_gpu" in sys.modules}


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--dir", default="/tmp/dynjax_probe_kernel_load")
  ap.add_argument("--out", default=None)
  ap.add_argument("--step", default="all", help="all | export | load:<variant>")
  args = ap.parse_args(argv)
  if args.step == "export":
    print(json.dumps(export_step(args.dir)))
    return {}
  if args.step.startswith("load:"):
    print(json.dumps(load_step(args.dir, args.step[5:])))
    return {}
  os.makedirs(args.dir, exist_ok=True)
  for f in os.listdir(args.dir):
    os.remove(os.path.join(args.dir, f))
  rec: dict = {}
  for step in ["export", "load:none", "load:lib", "load:runtime", "load:core", "load:dynjax"]:
    p = subprocess.run([sys.executable, __file__, "--dir", args.dir, "--step", step],
                       capture_output=True, text=True, timeout=300)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    rec[step] = json.loads(lines[-1]) if lines else {"rc": p.returncode,
                                                      "stderr": p.stderr[-1500:]}
    print(step, json.dumps(rec[step])[:700], flush=True)
  if args.out:
    import jax

    from benchmarks._report import write_json
    rec["jax"] = jax.__version__
    write_json(args.out, "probe_kernel_load.json", rec)
  return rec


if __name__ == "__main__":
  main()
