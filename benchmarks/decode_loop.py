"""Greedy decoding until an end token, on the device: a transformers Llama (2 layers, hidden 256,
random weights) with a ``StaticCache``, at most 64 new tokens, run three ways, each checked against
eager decoding first (the same tokens, which transformers' own greedy ``generate()`` gives too), then
timed:

- ``eager``: one eager decode step per token; the host reads the token after each (is it the end?);
- ``host_loop``: the decode step as a ``@cgraw.graphed`` function, a replay per token, the host
  reading the token after each;
- ``one_launch``: the whole loop as ``cgraw.while_loop`` inside ``cgraw.capture()`` (a WHILE
  conditional node): one replay per generation, one synchronisation.

Also ``step_graph_us``: the decode step captured alone and replayed back to back with no host read
(the step graph's device time, gaps between launches included), the floor a device-side loop can
approach. The end token is one eager decoding generates late in the sequence (its first
occurrence), so every system stops there. The prompt's prefill runs eagerly and is not timed.
Wall microseconds per token, the systems interleaved by round. ``python3 -m benchmarks.decode_loop
[--quick]`` writes ``benchmarks/results/decode_loop.json`` (``decode_loop_quick.json``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from benchmarks._harness import Report, bootstrap_ci, no_gpu

VOCAB, PROMPT, MAX_NEW, MIN_STOP = 1000, 8, 64, 24
ROUNDS, QUICK_ROUNDS = 15, 5


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python3 -m benchmarks.decode_loop", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_ROUNDS} rounds instead of {ROUNDS}")
    return ap.parse_args(argv)


def build(device: str = "cuda"):
    """``(torch, model, prompt, cache)``: the model and its ``StaticCache``."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   bos_token_id=0, eos_token_id=1, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(cfg).to(device).eval()
    prompt = torch.randint(0, VOCAB, (1, PROMPT), device=device)
    cache = transformers.StaticCache(config=model.config, max_cache_len=PROMPT + MAX_NEW + 8)
    return torch, model, prompt, cache


def decoder(torch, model, prompt, cache):
    """``(step, prefill)``: one greedy step ``(tok [1, 1], pos [1]) -> tok``, and the prompt's
    prefill into the emptied cache (its tensors keep their addresses) giving the first token."""
    @torch.no_grad()
    def step(tok, pos):
        out = model(input_ids=tok, position_ids=pos.view(1, 1), past_key_values=cache, use_cache=True)
        return out.logits[:, -1, :].argmax(-1, keepdim=True)

    @torch.no_grad()
    def prefill():
        cache.reset()
        return model(input_ids=prompt, past_key_values=cache, use_cache=True).logits[:, -1, :].argmax(-1, keepdim=True)

    return step, prefill


def host_decode(torch, step, first, end: int) -> list:
    """Tokens from ``first`` until ``end`` or ``MAX_NEW`` of them, the host reading each token."""
    tok, pos, toks = first, torch.tensor([PROMPT], device=first.device), [int(first)]
    while len(toks) < MAX_NEW and toks[-1] != end:
        tok = step(tok, pos)
        pos = pos + 1
        toks.append(int(tok))  # the host reads the token: one synchronisation per token
    return toks


def generate_tokens(torch, model, prompt, end: int) -> list:
    """The tokens of transformers' own greedy ``generate()`` from the prompt, with a fresh
    ``StaticCache``, stopping at ``end``: the reference every system's tokens are checked against."""
    import transformers

    cache = transformers.StaticCache(config=model.config, max_cache_len=PROMPT + MAX_NEW + 8)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=end, pad_token_id=end,
                             past_key_values=cache)
    return out[0, PROMPT:].tolist()


def end_token(tokens: list) -> int:
    """A token eager decoding generates late, at its first occurrence (so decoding stops there)."""
    for i in range(len(tokens) - 2, MIN_STOP - 1, -1):
        if tokens.index(tokens[i]) == i:
            return tokens[i]
    return -1  # none: every system decodes MAX_NEW tokens


def device_loop(torch, cgraw, step, prefill, end: int):
    """``(prepare, run, graph)``: the loop as one WHILE node; ``prepare`` prefills and writes the
    loop's start into the buffers the graph reads, ``run`` replays and returns the tokens."""
    dev = prefill().device
    out = torch.zeros(MAX_NEW, dtype=torch.int64, device=dev)
    tok0, pos0 = torch.zeros((1, 1), dtype=torch.int64, device=dev), torch.zeros(1, dtype=torch.int64, device=dev)
    n0, done0 = torch.zeros((), dtype=torch.int64, device=dev), torch.zeros((), dtype=torch.bool, device=dev)

    def cond_fn(tok, pos, n, done):
        return (~done) & (n < MAX_NEW)

    def body_fn(tok, pos, n, done):
        nxt = step(tok, pos)
        out.index_copy_(0, n.view(1), nxt.view(1))
        return nxt, pos + 1, n + 1, nxt.view(()) == end

    with cgraw.capture() as g:
        _, _, n_out, _ = cgraw.while_loop(cond_fn, body_fn, (tok0.clone(), pos0.clone(), n0.clone(), done0.clone()))

    def prepare():
        first = prefill()
        out.zero_()
        out[:1].copy_(first.view(1))
        tok0.copy_(first)
        pos0.fill_(PROMPT)
        n0.fill_(1)
        done0.copy_(first.view(()) == end)
        torch.cuda.synchronize()

    def run():
        g.replay()
        torch.cuda.synchronize()
        return out[:int(n_out)].tolist()

    return prepare, run, g


def step_graph_us(torch, cgraw, step, prefill, loops: int) -> float:
    """Microseconds per replay of the decode step's graph, replayed ``loops`` times back to back."""
    tok, pos = torch.zeros((1, 1), dtype=torch.int64, device="cuda"), torch.full((1,), PROMPT, device="cuda")
    with cgraw.capture() as g:
        step(tok, pos)
    samples = []
    for _ in range(5):
        tok.copy_(prefill())
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        for _ in range(loops):  # the cache's write position advances on the device: at most MAX_NEW - 1
            g.replay()
        torch.cuda.synchronize()
        samples.append((time.perf_counter_ns() - t0) / loops / 1e3)
    g.close()
    return statistics.median(samples)


def main(argv=None) -> int:
    args = _parse(argv)
    if no_gpu():
        return 2
    import cgraw

    rounds = QUICK_ROUNDS if args.quick else ROUNDS
    rep = Report("decode_loop_quick" if args.quick else "decode_loop")
    torch, model, prompt, cache = build()
    step, prefill = decoder(torch, model, prompt, cache)
    ref = host_decode(torch, step, prefill(), -1)
    end = end_token(ref)
    ref = host_decode(torch, step, prefill(), end)
    if end >= 0:  # transformers' greedy generate() stops at the same token with the same tokens
        def same_as_generate():
            got = generate_tokens(torch, model, prompt, end)
            if got != ref:
                raise AssertionError(f"generate() gives {got}, the eager decode loop {ref}")
        rep.check("generate", same_as_generate)
    graphed = cgraw.graphed(step)
    prepare_loop, run_loop, g_loop = device_loop(torch, cgraw, step, prefill, end)
    first = [None]

    def prepare_host():
        first[0] = prefill()
        torch.cuda.synchronize()
    systems = {"eager": (prepare_host, lambda: host_decode(torch, step, first[0], end)),
               "host_loop": (prepare_host, lambda: host_decode(torch, graphed, first[0], end)),
               "one_launch": (prepare_loop, run_loop)}
    ok = {}
    for name, (prepare, run) in systems.items():
        def check(prepare=prepare, run=run):
            for _ in range(3):  # the graphed step warms up, records, then replays
                prepare()
                got = run()
                if got != ref:
                    raise AssertionError(f"tokens {got} differ from eager's {ref}")
        ok[name] = rep.check(name, check)
    samples = {name: [] for name in systems if ok[name]}
    for _ in range(rounds):
        for name in samples:
            prepare, run = systems[name]
            prepare()
            t0 = time.perf_counter_ns()
            run()
            samples[name].append((time.perf_counter_ns() - t0) / 1e3 / len(ref))
    row = {"tokens": len(ref), "end_token": end}
    for name, v in samples.items():
        row[f"{name}_us_per_token"] = statistics.median(v)
    row["step_graph_us"] = step_graph_us(torch, cgraw, step, prefill, loops=MAX_NEW - 1)
    if "one_launch" in samples:
        row["one_launch_over_step_graph"] = row["one_launch_us_per_token"] / row["step_graph_us"]
        for name in ("eager", "host_loop"):
            if name in samples:
                ratios = [a / b for a, b in zip(samples[name], samples["one_launch"])]
                row[f"one_launch_speedup_over_{name}"] = statistics.median(ratios)
                row[f"one_launch_speedup_over_{name}_ci"] = bootstrap_ci([ratios])
        if "host_loop" in samples:
            row["round_trip_removed_us_per_token"] = row["host_loop_us_per_token"] - row["one_launch_us_per_token"]
    st = cgraw.report()
    rep.add(**row)
    g_loop.close()
    path = rep.save({"summary": row, "report": st, "method": {
        "rounds": rounds, "max_new_tokens": MAX_NEW, "prompt": PROMPT,
        "timing": "wall us per token: from after the (untimed) prefill to the tokens on the host, "
                  "divided by the tokens generated; systems interleaved by round"}})
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
