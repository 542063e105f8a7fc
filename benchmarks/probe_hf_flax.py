"""Hugging Face Flax models under ``dynjax.jit(padding="auto")`` against ``jax.jit`` (session 24).

  pip install "transformers<5" optax        # not dynjax dependencies: this probe only
  python benchmarks/probe_hf_flax.py --out $OUT [--models gpt2,llama,...] [--train gpt2,...]

Real client code dynjax has not seen: ``transformers``' Flax model classes (4.x; v5 drops
them), each built from a small random config (no download), called as their docs call them
(``model(input_ids, attention_mask=..., params=...)``) on a batch of 2 whose second row is a
third padding, with ``dims={"ids": "b, t", "m": "b, t"}`` and ``pow2(min=8)`` buckets.  For
each model and each length of ``--lengths``: the largest absolute difference from ``jax.jit``
at the exact shape; then the family's compiles and fallbacks.  ``--train``: the same for
``jax.value_and_grad`` of a masked loss (next-token cross entropy for causal models, a sum of
squares of the outputs otherwise), gradients included.  ``--stream N``: N lengths drawn
in 5..120, served by dynjax and by ``jax.jit`` (one compile per length), wall seconds each.
Writes ``probe_hf_flax.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._report import write_json  # noqa: E402

MODELS = ("bert,roberta,distilbert,electra,albert,xlmr,bigbird,roformer,gpt2,gptneo,gptj,opt,"
          "bloom,xglm,llama,mistral,gemma,bart,mbart,marian,pegasus,blenderbot,wav2vec2,t5")


def build(name: str):
  """(model, kind): kind is how it is called ("bert": ids + mask, "causal": logits,
  "encdec": decoder ids = ids, "audio": float samples)."""
  import transformers as T  # noqa: PLC0415

  small = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=64, max_position_embeddings=128)
  dec = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=64, max_position_embeddings=128)
  seq2seq = dict(vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2,
                 encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                 decoder_ffn_dim=64, max_position_embeddings=128)
  table = {
    "bert": lambda: (T.FlaxBertModel, T.BertConfig(**small), "bert"),
    "roberta": lambda: (T.FlaxRobertaModel, T.RobertaConfig(**small, pad_token_id=1), "bert"),
    "xlmr": lambda: (T.FlaxXLMRobertaModel, T.XLMRobertaConfig(**small, pad_token_id=1),
                     "bert"),
    "distilbert": lambda: (T.FlaxDistilBertModel, T.DistilBertConfig(
        vocab_size=100, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
        max_position_embeddings=128), "bert"),
    "electra": lambda: (T.FlaxElectraModel, T.ElectraConfig(**small, embedding_size=16),
                        "bert"),
    "albert": lambda: (T.FlaxAlbertModel, T.AlbertConfig(**small, embedding_size=16), "bert"),
    "bigbird": lambda: (T.FlaxBigBirdModel, T.BigBirdConfig(
        **small, attention_type="original_full"), "bert"),
    "roformer": lambda: (T.FlaxRoFormerModel, T.RoFormerConfig(**small, embedding_size=32),
                         "bert"),
    "gpt2": lambda: (T.FlaxGPT2LMHeadModel, T.GPT2Config(
        vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=128), "causal"),
    "gptneo": lambda: (T.FlaxGPTNeoForCausalLM, T.GPTNeoConfig(
        vocab_size=100, hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=128,
        attention_types=[[["global", "local"], 1]], window_size=8), "causal"),
    "gptj": lambda: (T.FlaxGPTJForCausalLM, T.GPTJConfig(
        vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=128, rotary_dim=4),
        "causal"),
    "opt": lambda: (T.FlaxOPTForCausalLM, T.OPTConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        ffn_dim=64, max_position_embeddings=128, word_embed_proj_dim=32), "causal"),
    "bloom": lambda: (T.FlaxBloomForCausalLM, T.BloomConfig(
        vocab_size=100, hidden_size=32, n_layer=2, n_head=4), "causal"),
    "xglm": lambda: (T.FlaxXGLMForCausalLM, T.XGLMConfig(
        vocab_size=100, d_model=32, num_layers=2, attention_heads=4, ffn_dim=64,
        max_position_embeddings=128), "causal"),
    "llama": lambda: (T.FlaxLlamaForCausalLM, T.LlamaConfig(**dec, num_key_value_heads=2),
                      "causal"),
    "mistral": lambda: (T.FlaxMistralForCausalLM, T.MistralConfig(
        **dec, num_key_value_heads=2, sliding_window=8), "causal"),
    "gemma": lambda: (T.FlaxGemmaForCausalLM, T.GemmaConfig(
        **dec, num_key_value_heads=1, head_dim=8), "causal"),
    "bart": lambda: (T.FlaxBartModel, T.BartConfig(**seq2seq), "encdec"),
    "mbart": lambda: (T.FlaxMBartModel, T.MBartConfig(**seq2seq), "encdec"),
    "marian": lambda: (T.FlaxMarianModel, T.MarianConfig(
        **seq2seq, pad_token_id=0, decoder_start_token_id=0), "encdec"),
    "pegasus": lambda: (T.FlaxPegasusModel, T.PegasusConfig(**seq2seq), "encdec"),
    "blenderbot": lambda: (T.FlaxBlenderbotSmallModel, T.BlenderbotSmallConfig(**seq2seq),
                           "encdec"),
    "wav2vec2": lambda: (T.FlaxWav2Vec2Model, T.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=4, feat_extract_norm="layer", do_stable_layer_norm=True),
        "audio"),
    "t5": lambda: (T.FlaxT5EncoderModel, T.T5Config(
        vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4), "bert"),
  }
  cls, cfg, kind = table[name]()
  return cls(cfg, seed=0), kind


def functions(model, kind):
  """(forward, loss) of ``(params, ids, mask)``."""
  import jax.numpy as jnp  # noqa: PLC0415
  import optax  # noqa: PLC0415

  def forward(params, ids, m):
    if kind == "encdec":
      return model(ids, attention_mask=m, decoder_input_ids=ids, params=params).last_hidden_state
    out = model(ids, attention_mask=m, params=params)
    return out.logits if kind == "causal" else out.last_hidden_state

  def loss(params, ids, m):
    y = forward(params, ids, m)
    if kind != "causal":
      return jnp.mean(jnp.square(y))
    ce = optax.softmax_cross_entropy_with_integer_labels(y[:, :-1], ids[:, 1:])
    w = m[:, 1:].astype(jnp.float32)
    return jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1.0)

  return forward, loss


def inputs(kind, t, rng):
  import numpy as np  # noqa: PLC0415

  t = t * 40 if kind == "audio" else t  # samples: the conv front end takes 320 a frame
  x = (rng.normal(size=(2, t)).astype(np.float32) if kind == "audio"
       else rng.integers(2, 100, size=(2, t)).astype(np.int32))
  m = np.ones((2, t), np.int32)
  m[1, t * 2 // 3:] = 0
  return x, m


def probe(name: str, train: bool, lengths, stream: int) -> dict:
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  import dynjax  # noqa: PLC0415

  model, kind = build(name)
  forward, loss = functions(model, kind)
  fn = jax.value_and_grad(loss) if train else forward
  g = dynjax.jit(fn, dims={"params": None, "ids": "b, t", "m": "b, t"},
                 buckets={"t": dynjax.buckets.pow2(min=8), "b": dynjax.buckets.explicit([2])},
                 padding="auto")
  ref = jax.jit(fn)
  rng = np.random.default_rng(0)
  rec = {"kind": kind, "max_abs_err": {}}
  for t in lengths:
    x, m = inputs(kind, t, rng)
    try:
      want = jax.tree.leaves(ref(model.params, x, m))
    except Exception as e:  # noqa: BLE001 - the model itself fails under jax.jit
      return {"kind": kind, "error_under_jax_jit": f"{type(e).__name__}: {str(e)[:300]}"}
    got = jax.tree.leaves(g(model.params, x, m))
    rec["max_abs_err"][int(x.shape[1])] = max(
        float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
        for a, b in zip(got, want, strict=True))
  st = g.stats()
  # repeated layers padded and lowered once a bucket (session 30): explain()'s lines for it
  rec["outlined"] = [ln.strip() for ln in g.explain().splitlines() if "repeated" in ln]
  rec.update(compiles=st["compiles"], fallbacks=st["fallbacks"], guards=list(
      g.trace(model.params, *inputs(kind, lengths[0], rng)).family.guards))
  if stream:
    ts = np.random.default_rng(1).integers(5, 121, size=stream)
    calls = [inputs(kind, int(t), rng) for t in ts]
    for label, f in (("dynjax", g), ("jax.jit", ref)):
      t0 = time.perf_counter()
      for x, m in calls:
        jax.block_until_ready(f(model.params, x, m))
      rec[f"stream_{label}_s"] = time.perf_counter() - t0
    rec["stream_lengths"] = len(set(ts.tolist()))
  return rec


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--models", default=MODELS)
  ap.add_argument("--train", default="gpt2,llama,bert,roformer,wav2vec2",
                  help="models whose value_and_grad is probed too (empty: none)")
  ap.add_argument("--lengths", default="5,16,23,40")
  ap.add_argument("--stream", type=int, default=0, help="lengths of the timed stream (0: none)")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  warnings.simplefilter("ignore")  # transformers' Flax deprecation, dynjax's fallback warnings
  import jax  # noqa: PLC0415
  import transformers  # noqa: PLC0415

  lengths = [int(t) for t in args.lengths.split(",")]
  report = {"jax": jax.__version__, "transformers": transformers.__version__,
            "device": jax.devices()[0].device_kind, "models": {}}
  for part, names in (("forward", args.models), ("train", args.train)):
    for name in filter(None, names.split(",")):
      t0 = time.perf_counter()
      try:
        rec = probe(name, part == "train", lengths, args.stream if part == "forward" else 0)
      except Exception as e:  # noqa: BLE001 - one model must not lose the others
        rec = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
      rec["seconds"] = time.perf_counter() - t0
      report["models"][f"{name} {part}"] = rec
      err = max(rec.get("max_abs_err", {}).values(), default=float("nan"))
      print(f"{name:10s} {part:7s} max err {err:9.2e}  compiles {rec.get('compiles', '-')}  "
            f"fallbacks {len(rec.get('fallbacks', []))}  outlined {len(rec.get('outlined', []))}  "
            f"{rec.get('error', rec.get('error_under_jax_jit', ''))[:120]}"
            + (f"  stream dynjax {rec['stream_dynjax_s']:.1f} s / jax.jit "
               f"{rec['stream_jax.jit_s']:.1f} s ({rec['stream_lengths']} lengths)"
               if "stream_dynjax_s" in rec else ""), flush=True)
  write_json(args.out, "probe_hf_flax.json", report)
  return report


if __name__ == "__main__":
  main()
