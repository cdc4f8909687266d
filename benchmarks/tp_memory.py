"""Peak resident memory per rank for a sharded checkpoint load: TP=1 against TP=2.

    python benchmarks/tp_memory.py [--hidden 2048] [--layers 6] [--reps 3] \
        [--json benchmarks/results/tp_memory.json]

Writes a random Llama checkpoint (float32 safetensors, 64 MB shards; 1.5 GiB by default) once,
then loads it in a fresh process per measurement: TP=1 (the baseline: the whole model) and each
rank of TP=2 (its slices only, read into the preallocated parameters by
gpu_worker/safetensors_reader.py; loading needs no process group). A second baseline,
"tp2-rank0 get_slice", loads rank 0's slices the way safetensors' `safe_open(...).get_slice`
does (mapped file, a new tensor per slice, then a copy), to show what the reader saves.

Each process reports its peak RSS (ru_maxrss: anonymous and file-mapped pages both) and its RSS
just before loading (after importing torch, ~250 MiB), so the load's own cost is the
difference. Repetitions interleave the loaders; the table shows the median and the spread
(max - min). Target: a TP=2 rank's whole-process peak at most 0.6x TP=1's.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvledger.report import format_table  # noqa: E402

MiB = 1024 * 1024


def write_checkpoint(folder: Path, hidden: int, layers: int, vocab: int) -> int:
    import torch

    inter, heads, kv_heads = hidden * 11 // 4, hidden // 64, 4
    cfg = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "max_position_embeddings": 2048, "dtype": "float32",
    }  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    kv = kv_heads * 64
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden),
              "model.norm.weight": (hidden,)}  # fmt: skip
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter), p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    weight_map, shard, size, total, n = {}, {}, 0, 0, 0

    def flush() -> None:
        nonlocal shard, size, n
        name = f"model-{n:05d}.safetensors"
        save_safetensors(shard, folder / name)
        weight_map.update(dict.fromkeys(shard, name))
        shard, size, n = {}, 0, n + 1

    for name, shape in shapes.items():
        shard[name] = torch.randn(shape, generator=gen) * 0.02
        size += shard[name].nbytes
        total += shard[name].nbytes
        if size >= 64 * MiB:
            flush()
    if shard:
        flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


def save_safetensors(tensors: dict, path: Path) -> None:
    """float32 tensors in the safetensors layout, written without the safetensors package (the
    GPU machine's image may lack it and reaches no package index)."""
    header, offset = {}, 0
    for name, tensor in tensors.items():
        header[name] = {"dtype": "F32", "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + tensor.nbytes]}  # fmt: skip
        offset += tensor.nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with path.open("wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for tensor in tensors.values():
            f.write(tensor.float().contiguous().numpy().tobytes())


def child(folder: str, rank: int, size: int, loader: str) -> None:
    import torch  # noqa: F401 (its import is the baseline, not the load)

    from gpu_worker.checkpoint import load_checkpoint
    from gpu_worker.parallel import TensorParallel

    before = _rss_now()
    tp = TensorParallel(rank, size)
    if loader == "get_slice":
        params = load_with_get_slice(Path(folder), tp)
    else:
        params = list(load_checkpoint(folder, dtype="float32", tp=tp).parameters())
    held = sum(p.nbytes for p in params)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"before": before, "peak": peak, "params": held}))


def load_with_get_slice(folder: Path, tp) -> list:
    """The previous loader's reads: each rank's slice through safetensors' mapped get_slice."""
    import torch
    from safetensors import safe_open

    from gpu_worker.checkpoint import read_model_config, weight_files
    from gpu_worker.model import LlamaForCausalLM

    with torch.device("meta"):
        net = LlamaForCausalLM(read_model_config(folder), tp)
    net = net.to_empty(device="cpu")
    params = dict(net.named_parameters())
    for file in weight_files(folder):
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            for name in reader.keys():  # noqa: SIM118 (safe_open is not a dict)
                slices = net.full_slices(name)
                part = reader.get_slice(name)
                part = part[slices] if slices is not None else part[:]
                with torch.no_grad():
                    params[name][: part.shape[0]].copy_(part)
    return list(params.values())


def _rss_now() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def measure(folder: Path, rank: int, size: int, loader: str) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(folder), str(rank), str(size), loader],
        check=True, capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", nargs=4, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), int(args.child[2]), args.child[3])
        return
    order = [
        ("tp1", 0, 1, "reader"),
        ("tp2-rank0", 0, 2, "reader"),
        ("tp2-rank1", 1, 2, "reader"),
        ("tp2-rank0 get_slice", 0, 2, "get_slice"),
    ]
    runs: dict[str, list[dict]] = {label: [] for label, *_ in order}
    with tempfile.TemporaryDirectory() as tmp:
        weights = write_checkpoint(Path(tmp) / "ckpt", args.hidden, args.layers, args.vocab)
        for rep in range(args.reps):
            for label, rank, size, loader in order if rep % 2 == 0 else order[::-1]:
                runs[label].append(measure(Path(tmp) / "ckpt", rank, size, loader))
    rows, summary = [], {}
    for label, samples in runs.items():
        peaks = [s["peak"] / MiB for s in samples]
        loads = [(s["peak"] - s["before"]) / MiB for s in samples]
        summary[label] = {
            "peak_rss_mib": statistics.median(peaks), "peak_spread_mib": max(peaks) - min(peaks),
            "load_rss_mib": statistics.median(loads), "load_spread_mib": max(loads) - min(loads),
            "params_mib": samples[0]["params"] / MiB, "samples": samples,
        }  # fmt: skip
    base = summary["tp1"]
    for label, s in summary.items():
        s["peak_ratio_vs_tp1"] = s["peak_rss_mib"] / base["peak_rss_mib"]
        s["load_ratio_vs_tp1"] = s["load_rss_mib"] / base["load_rss_mib"]
        rows.append([
            label, f"{s['params_mib']:.0f}", f"{s['peak_rss_mib']:.0f} ±{s['peak_spread_mib']:.0f}",
            f"{s['peak_ratio_vs_tp1']:.2f}x", f"{s['load_rss_mib']:.0f} ±{s['load_spread_mib']:.0f}",
            f"{s['load_ratio_vs_tp1']:.2f}x",
        ])  # fmt: skip
    print(f"checkpoint: {weights / MiB:.0f} MiB float32, {args.reps} interleaved repetitions")
    headers = ["rank", "params MiB", "peak RSS MiB", "vs tp1", "load RSS MiB", "vs tp1"]
    print(format_table(headers, rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        result = {"weights_mib": weights / MiB, "args": {k: v for k, v in vars(args).items()
                  if k not in ("json", "child")}, "results": summary}  # fmt: skip
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
