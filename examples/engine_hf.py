#!/usr/bin/env python3
"""The engine loop of engine_numpy.py driving a Hugging Face transformers Llama-architecture model, with
pagedkv as its K/V cache and attention.

The model's own modules run everything but attention (embedding, norms, projections, rotary
positions, MLP, head); each layer's K/V go into a pagedkv pool and its attention is pkv_decode, over
torch tensors (on the GPU: device pointers, on a torch stream the pagedkv context shares). The loop
is engine_numpy.py's: ragged prompts joining and leaving, chunked prefill of up to 8 tokens, a fork
for parallel sampling, speculative drafts verified in one decode and truncated. Every step's logits
are checked against the model's own forward pass over each sequence's whole token list (no cache).

usage: engine_hf.py [--model PATH] [--dtype float16|bfloat16|float32] [--device cuda|cpu] [--seed N]
  Without --model, a small Llama (2 layers, 8 query heads over 4 KV heads, head_dim 64, vocabulary
  1024) with seeded random weights. --model: a local checkpoint of a Llama-architecture model.
Needs torch and transformers (4.38 or newer), numpy, and the pagedkv package with its library:
  PYTHONPATH=python PAGEDKV_LIBRARY=build/lib/libpagedkv.so python3 examples/engine_hf.py
Exits 77 (skipped) with a message when torch or transformers is missing.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import random
import sys
import time
from pathlib import Path
from typing import Dict, List

try:
    import torch
    import transformers
except ImportError as missing:
    print(f"engine_hf.py needs torch and transformers ({missing}): skipped")
    sys.exit(77)

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pagedkv  # noqa: E402
from engine_numpy import Seq, check_logits, decode_by_count, make_requests, new_tokens, run, serve  # noqa: E402

PAGE_FORMATS = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}
TOLERANCE = {torch.float16: 3e-2, torch.bfloat16: 8e-2, torch.float32: 1e-3}


def load_model(path: str, dtype: torch.dtype, device: str, seed: int):
    if path:
        model = transformers.AutoModelForCausalLM.from_pretrained(path).to(dtype)
    else:
        config = transformers.LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1024,
                                          num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                                          max_position_embeddings=1024)
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config).to(dtype)
    if model.config.model_type != "llama":
        raise SystemExit(f"{path}: model type {model.config.model_type!r}; this example drives Llama-architecture models")
    return model.to(device).eval()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class HfEngine:
    """A transformers Llama model whose attention and K/V cache are pagedkv's."""

    def __init__(self, model, device: str, seed: int, tolerance: float):
        self.model = model
        cfg = model.config
        self.vocab = cfg.vocab_size
        self.q_heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.device = device
        self.dtype = next(model.parameters()).dtype
        # The library and torch must use one stream: a stream of torch's own, current while the
        # engine runs, handed to the context (torch's default stream has handle 0, which
        # pkv_context_desc reads as "the library's own stream").
        self.stream = torch.cuda.Stream() if device == "cuda" else None
        self.ctx = pagedkv.Context(backend="cuda" if device == "cuda" else "cpu", stream=self.stream)
        fmt = PAGE_FORMATS[self.dtype]
        self.pool = self.ctx.pool(layers=cfg.num_hidden_layers, kv_heads=self.kv_heads, head_dim=self.head_dim,
                                  page_size=16, pages=512, max_sequences=32, k_format=fmt, v_format=fmt,
                                  page_order_seed=seed % 1000 + 1)
        inner = model.model
        self.rotary = getattr(inner, "rotary_emb", None) or inner.layers[0].self_attn.rotary_emb
        self.tolerance = tolerance
        self.worst = 0.0
        self.checked = 0
        self.decode_calls = 0
        self.step_seconds = 0.0

    @torch.no_grad()
    def step(self, batch: List[Seq], drafts: Dict[str, List[int]]) -> Dict[str, np.ndarray]:
        started = time.perf_counter()
        with torch.cuda.stream(self.stream) if self.stream else contextlib.nullcontext():
            logits = self._step(batch, drafts)
            out = {name: rows.float().cpu().numpy() for name, rows in logits.items()}
        self.step_seconds += time.perf_counter() - started
        return out

    def _step(self, batch: List[Seq], drafts: Dict[str, List[int]]) -> Dict[str, torch.Tensor]:
        new = new_tokens(batch, drafts)
        counts = [len(new[s.name]) for s in batch]
        handles = [s.handle for s in batch]
        self.pool.append(handles, counts)
        for s in batch:
            s.tokens += new[s.name]
        dev = self.device
        ids = torch.tensor([t for s in batch for t in new[s.name]], device=dev)
        positions = torch.tensor([p for s, c in zip(batch, counts) for p in range(len(s.tokens) - c, len(s.tokens))],
                                 device=dev)
        inner = self.model.model
        x = inner.embed_tokens(ids)
        cos, sin = self.rotary(x[None], positions[None])
        cos, sin = cos[0, :, None, :].to(x.dtype), sin[0, :, None, :].to(x.dtype)
        n = len(ids)
        for layer_index, layer in enumerate(inner.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(n, self.q_heads, self.head_dim)
            k = attn.k_proj(h).view(n, self.kv_heads, self.head_dim)
            v = attn.v_proj(h).view(n, self.kv_heads, self.head_dim).contiguous()
            q = (q * cos + rotate_half(q) * sin).contiguous()
            k = (k * cos + rotate_half(k) * sin).contiguous()
            self.pool.write(layer_index, handles, counts, k, v)
            out, calls = decode_by_count(self.pool, layer_index, handles, counts, q, torch.stack)
            self.decode_calls += calls
            x = x + attn.o_proj(out.reshape(n, self.q_heads * self.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        logits = self.model.lm_head(inner.norm(x))
        offsets = np.concatenate([[0], np.cumsum(counts)]).tolist()
        return {s.name: logits[offsets[i]:offsets[i + 1]] for i, s in enumerate(batch)}

    @torch.no_grad()
    def reference(self, tokens: List[int]) -> np.ndarray:
        """The model's own forward pass over the whole token list, without a cache."""
        ids = torch.tensor([tokens], device=self.device)
        return self.model(input_ids=ids, use_cache=False).logits[0].double().cpu().numpy()

    def check(self, s: Seq, logits: np.ndarray) -> None:
        check_logits(self, s, logits, self.reference(s.tokens)[-len(logits):])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="a local Llama-architecture checkpoint (default: random weights)")
    ap.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="float16")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=int(os.environ.get("PKV_TEST_SEED") or random.randrange(1, 2**31)))
    ap.add_argument("--requests", type=int, default=7)
    ap.add_argument("--tolerance", type=float, help="largest logit difference relative to the largest logit "
                    "(default by dtype: float16 3e-2, bfloat16 8e-2, float32 1e-3)")
    args = ap.parse_args()
    if tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (4, 38):
        print(f"engine_hf.py needs transformers 4.38 or newer (rotary embeddings by position), not "
              f"{transformers.__version__}: skipped")
        return 77
    print(f"# PKV_TEST_SEED={args.seed} (--seed replays the run)")
    dtype = getattr(torch, args.dtype)
    model = load_model(args.model, dtype, args.device, args.seed)
    engine = HfEngine(model, args.device, args.seed, args.tolerance or TOLERANCE[dtype])
    cfg = model.config
    print(f"pagedkv {pagedkv.library_version()} on {engine.ctx.backend.name.lower()}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}; model {args.model or 'random Llama'}: {cfg.num_hidden_layers} "
          f"layers, {engine.q_heads}/{engine.kv_heads} heads, head_dim {engine.head_dim}, {args.dtype}")
    rng = random.Random(args.seed)
    result = serve(engine, make_requests(rng, args.requests, engine.vocab), rng)
    engine.pool.close()
    engine.ctx.close()
    print(f"{result['completions']} completions, {result['tokens']} tokens in {result['steps']} steps; "
          f"{engine.checked} logit rows checked against the model's forward, largest relative error "
          f"{engine.worst:.2e}; engine steps {engine.step_seconds:.2f} s: "
          f"{result['tokens'] / max(engine.step_seconds, 1e-9):.0f} tokens/s (small batches, checks excluded)")
    return 0


if __name__ == "__main__":
    run(main)
