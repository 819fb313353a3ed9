#!/usr/bin/env python3
"""An inference engine's loop on pagedkv, driving a small decoder-only transformer written with numpy.

The model (random weights from a seed): 2 layers, 8 query heads over 4 KV heads (GQA 2), head_dim 64,
RMSNorm, rotary positions, a SiLU-gated MLP, vocabulary 256. Its K/V cache and attention are
pagedkv's; everything else is numpy in float32.

The loop does what a serving engine does:
- requests with ragged prompts arrive over time and join the running batch (continuous batching);
  finished ones leave and their sequences are freed;
- prompts are prefilled in chunks of up to 8 tokens: the chunk is appended and written, then decoded
  with q_tokens = chunk length (query token t of a sequence of length L sees positions 0..L - T + t);
- one request samples several completions in parallel: after its prompt, its sequence is forked;
- one request decodes speculatively: each step appends its last token plus 3 draft tokens, verifies
  them in one decode (q_tokens 4) and truncates the rejected ones.

Every step's logits are checked against the same model run with plain full attention over each
sequence's whole token list in float64 (no cache), within a tolerance. Exits 1 on a mismatch.

usage: engine_numpy.py [--seed N] [--kv-format f32|f16] [--requests N]
Needs numpy and the pagedkv package (PYTHONPATH=python, PAGEDKV_LIBRARY=build/lib/libpagedkv.so).
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

try:
    import numpy as np
except ImportError:
    print("engine_numpy.py needs numpy (Debian: apt-get install python3-numpy): skipped")
    sys.exit(77)

import pagedkv

LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM, VOCAB, HIDDEN = 2, 8, 4, 64, 256, 512
D_MODEL = Q_HEADS * HEAD_DIM
MAX_CHUNK = 8  # pkv_decode's q_tokens limit
DRAFT = 3


class Model:
    """The weights, and the pieces of a forward pass shared by the engine and the reference."""

    def __init__(self, seed: int):
        g = np.random.default_rng(seed)
        w = lambda *shape: g.standard_normal(shape) / np.sqrt(shape[0])  # noqa: E731
        self.embed = g.standard_normal((VOCAB, D_MODEL))
        self.layers = [dict(norm1=1 + 0.1 * g.standard_normal(D_MODEL), wq=w(D_MODEL, Q_HEADS * HEAD_DIM),
                            wk=w(D_MODEL, KV_HEADS * HEAD_DIM), wv=w(D_MODEL, KV_HEADS * HEAD_DIM),
                            wo=w(Q_HEADS * HEAD_DIM, D_MODEL), norm2=1 + 0.1 * g.standard_normal(D_MODEL),
                            w_gate=w(D_MODEL, HIDDEN), w_up=w(D_MODEL, HIDDEN), w_down=w(HIDDEN, D_MODEL))
                       for _ in range(LAYERS)]
        self.norm = 1 + 0.1 * g.standard_normal(D_MODEL)
        self.unembed = w(D_MODEL, VOCAB)
        inv = 1.0 / 10000 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
        self.rope_freq = inv

    def cast(self, dtype) -> "Model":
        m = Model.__new__(Model)
        m.embed, m.norm, m.unembed, m.rope_freq = (x.astype(dtype) for x in
                                                   (self.embed, self.norm, self.unembed, self.rope_freq))
        m.layers = [{k: v.astype(dtype) for k, v in layer.items()} for layer in self.layers]
        return m


def rms_norm(x, weight):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6) * weight


def rope(x, positions, freq):
    """Rotary embedding of x [tokens, heads, head_dim] at the given positions (halves rotated)."""
    angle = positions[:, None].astype(freq.dtype) * freq[None, :]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    a, b = x[..., :HEAD_DIM // 2], x[..., HEAD_DIM // 2:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def mlp(x, p):
    gate = x @ p["w_gate"]
    return (gate / (1 + np.exp(-gate)) * (x @ p["w_up"])) @ p["w_down"]


def stored(kv, fmt: str):
    """K/V as a page of format fmt holds them."""
    return kv if fmt == "f32" else kv.astype(np.float16).astype(kv.dtype)


def reference_logits(model: Model, tokens: List[int], kv_format: str):
    """The model over the whole token list with plain causal attention, float64, no cache."""
    n = len(tokens)
    x = model.embed[tokens]
    pos = np.arange(n)
    mask = np.tril(np.ones((n, n), bool))
    for p in model.layers:
        h = rms_norm(x, p["norm1"])
        q = rope((h @ p["wq"]).reshape(n, Q_HEADS, HEAD_DIM), pos, model.rope_freq)
        k = stored(rope((h @ p["wk"]).reshape(n, KV_HEADS, HEAD_DIM), pos, model.rope_freq), kv_format)
        v = stored((h @ p["wv"]).reshape(n, KV_HEADS, HEAD_DIM), kv_format)
        k, v = np.repeat(k, Q_HEADS // KV_HEADS, axis=1), np.repeat(v, Q_HEADS // KV_HEADS, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(HEAD_DIM)
        scores = np.where(mask[None], scores, -np.inf)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", weights, v).reshape(n, D_MODEL)
        x = x + attn @ p["wo"]
        x = x + mlp(rms_norm(x, p["norm2"]), p)
    return rms_norm(x, model.norm) @ model.unembed


@dataclass
class Seq:
    """One running sequence: its pagedkv handle, every token it holds, and what it still has to do."""
    name: str
    handle: pagedkv.Sequence
    tokens: List[int]            # tokens whose K/V are (or, this step, will be) in the cache
    prompt_left: List[int]       # prompt tokens not yet prefilled
    pending: Optional[int]       # the sampled token not yet in the cache
    to_generate: int
    generated: List[int] = field(default_factory=list)
    speculative: bool = False
    forks: int = 0               # completions to fork off once the prompt is in
    sampler: Optional[random.Random] = None


def decode_by_count(pool: pagedkv.Pool, layer: int, handles, counts: List[int], q, stack):
    """Attention of the step's packed query rows q [sum counts, q_heads, head_dim]: pkv_decode takes
    one q_tokens for its whole batch, so sequences are grouped by their count of new tokens, one
    call a group. stack is numpy.stack or torch.stack. Returns the rows in q's order."""
    out = q.new_empty(q.shape) if hasattr(q, "new_empty") else np.empty_like(q)
    offsets = np.concatenate([[0], np.cumsum(counts)]).tolist()
    for t in sorted(set(counts)):
        group = [i for i, c in enumerate(counts) if c == t]
        rows = pool.decode(layer, [handles[i] for i in group], stack([q[offsets[i]:offsets[i + 1]] for i in group]))
        for j, i in enumerate(group):
            out[offsets[i]:offsets[i + 1]] = rows[j]
    return out, len(set(counts))


def new_tokens(batch: List[Seq], drafts: Dict[str, List[int]]) -> Dict[str, List[int]]:
    """What each sequence adds this step: its next prompt chunk, or its pending token and drafts."""
    return {s.name: s.prompt_left[:MAX_CHUNK] if s.prompt_left else [s.pending] + drafts.get(s.name, [])
            for s in batch}


class NumpyEngine:
    """The model on numpy (float32) with pagedkv as its K/V cache and attention, checked against the
    float64 model with full attention."""

    def __init__(self, model: Model, kv_format: str, seed: int):
        self.model = model.cast(np.float32)
        self.reference_model = model
        self.kv_format = kv_format
        self.vocab = VOCAB
        self.ctx = pagedkv.Context()
        self.pool = self.ctx.pool(layers=LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, page_size=16, pages=256,
                                  max_sequences=32, k_format=kv_format, v_format=kv_format, page_order_seed=seed % 1000 + 1)
        self.worst = 0.0
        self.checked = 0
        self.decode_calls = 0
        self.tolerance = 1e-3 if kv_format == "f32" else 2e-2

    def step(self, batch: List[Seq], drafts: Dict[str, List[int]]) -> Dict[str, np.ndarray]:
        """One engine step: every sequence's new tokens are appended, then each layer writes their K/V
        and decodes them. Returns each sequence's logits for its new tokens."""
        new = new_tokens(batch, drafts)
        counts = [len(new[s.name]) for s in batch]
        handles = [s.handle for s in batch]
        self.pool.append(handles, counts)
        for s in batch:
            s.tokens += new[s.name]
        ids = np.concatenate([new[s.name] for s in batch])
        positions = np.concatenate([np.arange(len(s.tokens) - c, len(s.tokens)) for s, c in zip(batch, counts)])
        m = self.model
        x = m.embed[ids]
        for layer, p in enumerate(m.layers):
            h = rms_norm(x, p["norm1"])
            q = rope((h @ p["wq"]).reshape(-1, Q_HEADS, HEAD_DIM), positions, m.rope_freq)
            k = rope((h @ p["wk"]).reshape(-1, KV_HEADS, HEAD_DIM), positions, m.rope_freq)
            v = (h @ p["wv"]).reshape(-1, KV_HEADS, HEAD_DIM)
            self.pool.write(layer, handles, counts, k, v)
            attn, calls = decode_by_count(self.pool, layer, handles, counts, q, np.stack)
            self.decode_calls += calls
            x = x + attn.reshape(-1, D_MODEL) @ p["wo"]
            x = x + mlp(rms_norm(x, p["norm2"]), p)
        logits = rms_norm(x, m.norm) @ m.unembed
        offsets = np.concatenate([[0], np.cumsum(counts)])
        return {s.name: logits[offsets[i]:offsets[i + 1]] for i, s in enumerate(batch)}

    def reference(self, tokens: List[int]) -> np.ndarray:
        return reference_logits(self.reference_model, tokens, self.kv_format)

    def check(self, s: Seq, logits: np.ndarray) -> None:
        check_logits(self, s, logits, self.reference(s.tokens)[-len(logits):])


def check_logits(engine, s: Seq, logits: np.ndarray, ref: np.ndarray) -> None:
    """One sequence's logits of this step against the reference's for the same positions: the largest
    difference relative to the largest reference logit must be within engine.tolerance."""
    err = float(np.abs(logits.astype(np.float64) - ref).max() / max(1e-6, np.abs(ref).max()))
    engine.worst = max(engine.worst, err)
    engine.checked += len(logits)
    if len(s.handle) != len(s.tokens):
        raise AssertionError(f"{s.name}: the pool holds {len(s.handle)} tokens, the engine {len(s.tokens)}")
    if err > engine.tolerance:
        raise AssertionError(f"{s.name} at {len(s.tokens)} tokens: logits differ from the reference by {err:.3e} "
                             f"(relative to the largest logit; tolerance {engine.tolerance})")


def make_requests(rng: random.Random, count: int, vocab: int):
    """(arrival step, prompt, tokens to generate, kind): ragged prompts (one of a single token); one
    request forks 2 extra completions, one decodes speculatively."""
    requests = []
    for i in range(count):
        length = 1 if i == 1 else rng.randrange(2, 40)
        kind = "fork" if i == 2 else "spec" if i == 3 else "plain"
        n = 16 if kind == "spec" else rng.randrange(4, 12)
        requests.append((2 * i, [rng.randrange(vocab) for _ in range(length)], n, kind))
    return requests


def serve(engine, requests, rng: random.Random, max_running: int = 5) -> dict:
    """The engine loop over the requests: arrivals join the batch, prompts prefill in chunks, a fork
    request forks after its prompt, the speculative one verifies drafts and truncates what fails,
    finished sequences leave. engine has pool, vocab, step(), check() and reference(tokens)."""
    waiting = list(requests)
    running: List[Seq] = []
    finished = step = tokens_out = 0
    started = time.perf_counter()
    while waiting or running:
        while waiting and waiting[0][0] <= step and len(running) < max_running:
            _, prompt, n, kind = waiting.pop(0)
            name = f"r{len(requests) - len(waiting) - 1}"
            running.append(Seq(name, engine.pool.alloc(), [], list(prompt), None, n, speculative=kind == "spec",
                               forks=2 if kind == "fork" else 0, sampler=random.Random(rng.random())))
            print(f"step {step:3d}: {name} joins ({len(prompt)} prompt tokens, {n} to generate, {kind})")
        if not running:
            step += 1
            continue

        # Drafts for the speculative sequence: the reference's greedy continuation up to a random
        # point, then a wrong token, so that each verification accepts some and rejects the rest.
        drafts = {}
        for s in running:
            if s.speculative and not s.prompt_left and s.pending is not None:
                good: List[int] = []
                for _ in range(DRAFT):
                    good.append(int(np.argmax(engine.reference(s.tokens + [s.pending] + good)[-1])))
                cut = rng.randrange(DRAFT + 1)
                drafts[s.name] = good[:cut] + [(t + 1) % engine.vocab for t in good[cut:cut + 1]] + good[cut + 1:]

        logits = engine.step(running, drafts)
        for s in list(running):
            engine.check(s, logits[s.name])
            if s.prompt_left:
                s.prompt_left = s.prompt_left[MAX_CHUNK:]
                if s.prompt_left:
                    continue
                last = logits[s.name][-1]
                s.pending = int(np.argmax(last))
                for f in range(s.forks):  # parallel sampling: completions share the prompt's pages
                    child = Seq(f"{s.name}.{f + 1}", s.handle.fork(), list(s.tokens), [], None, s.to_generate,
                                sampler=random.Random(rng.random()))
                    child.pending = sample(last, child.sampler)
                    child.generated.append(child.pending)
                    running.append(child)
                    print(f"step {step:3d}: {s.name} forks {child.name} at {len(s.tokens)} tokens "
                          f"(pages shared: {engine.pool.stats().pages_shared})")
                s.generated.append(s.pending)
            elif s.name in drafts:
                draft = drafts[s.name]
                rows = logits[s.name]
                accepted = 0
                while accepted < len(draft) and int(np.argmax(rows[accepted])) == draft[accepted]:
                    accepted += 1
                keep = len(s.tokens) - len(draft) + accepted
                s.handle.truncate(keep)
                del s.tokens[keep:]
                s.generated += draft[:accepted]
                s.pending = int(np.argmax(rows[accepted]))
                s.generated.append(s.pending)
                print(f"step {step:3d}: {s.name} verifies {len(draft)} drafts: {accepted} accepted, "
                      f"{len(draft) - accepted} truncated")
            else:
                row = logits[s.name][-1]
                s.pending = sample(row, s.sampler) if "." in s.name else int(np.argmax(row))
                s.generated.append(s.pending)
            if len(s.generated) >= s.to_generate:
                s.handle.free()
                running.remove(s)
                finished += 1
                tokens_out += len(s.generated)
                print(f"step {step:3d}: {s.name} leaves with {len(s.generated)} tokens: "
                      f"{' '.join(map(str, s.generated[:12]))}")
        step += 1
    stats = engine.pool.stats()
    if stats.sequences_live != 0 or stats.pages_free != stats.pages_total:
        raise AssertionError(f"pages left behind after every sequence was freed: {stats}")
    return dict(completions=finished, tokens=tokens_out, steps=step, seconds=time.perf_counter() - started)


def sample(logits: np.ndarray, r: random.Random) -> int:
    """A token drawn from softmax(logits) with the sequence's own random stream."""
    p = np.exp(logits.astype(np.float64) - logits.max())
    return int(np.searchsorted(np.cumsum(p), r.random() * p.sum()).clip(0, len(p) - 1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=int(os.environ.get("PKV_TEST_SEED") or random.randrange(1, 2**31)))
    ap.add_argument("--kv-format", choices=["f32", "f16"], default="f32")
    ap.add_argument("--requests", type=int, default=7)
    args = ap.parse_args()
    print(f"# PKV_TEST_SEED={args.seed} (--seed replays the run)")
    rng = random.Random(args.seed)
    engine = NumpyEngine(Model(args.seed), args.kv_format, args.seed)
    print(f"pagedkv {pagedkv.library_version()} on {engine.ctx.backend.name.lower()}; K/V pages {args.kv_format}")
    result = serve(engine, make_requests(rng, args.requests, VOCAB), rng)
    engine.pool.close()
    engine.ctx.close()
    print(f"{result['completions']} completions, {result['tokens']} tokens in {result['steps']} steps "
          f"({engine.decode_calls} decode calls, {result['seconds']:.1f} s with the float64 checks); "
          f"{engine.checked} logit rows checked, largest relative error {engine.worst:.2e}")
    return 0


def run(entry) -> None:
    """Exits with entry()'s status; a failed check (AssertionError) prints why and exits 1."""
    try:
        sys.exit(entry())
    except AssertionError as e:
        print(f"FAILED: {e}")
        sys.exit(1)


if __name__ == "__main__":
    run(main)
