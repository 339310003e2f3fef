"""The Python side of tools/gpu_check.sh, run with the GPU host's python3 (its CUDA PyTorch and
HuggingFace transformers). Subcommands:

  probe                          exit 0 and print the GPU when torch sees one; else say why, exit 2
  input DIR SEQ BATCH OUT.json   token rows for a BertModel checkpoint (ids from its vocabulary)
  parity DIR INPUT OURS DTYPE    HF's BertModel on the GPU in DTYPE against our outputs (float32
                                 safetensors): prints the largest difference per output, relative to
                                 the largest value, and exits 1 past the dtype's tolerance
  throughput DIR INPUT DTYPE N   HF's BertModel on the GPU in DTYPE, eager and torch.compile: rows/s
                                 as one JSON line

Tolerances (issue 11): 1e-4 in fp32, 1e-2 in fp16 and bf16, each relative to the output's largest
magnitude (at least 1).

$BERTSHARD_GPU_CHECK_DEVICE (default cuda) is the device HF runs on: tests/gpu_check_test.sh sets
cpu to run the comparison itself on a machine without a GPU.
"""
import json
import os
import sys
import time

DEVICE = os.environ.get("BERTSHARD_GPU_CHECK_DEVICE", "cuda")

TOLERANCE = {"fp32": 1e-4, "fp16": 1e-2, "bf16": 1e-2}


def torch_dtype(torch, name):
    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


def probe():
    try:
        import torch
    except ImportError as e:
        print(f"no usable GPU: python3 cannot import torch ({e})")
        return 2
    if not torch.cuda.is_available():
        print(f"no usable GPU: torch {torch.__version__} sees no CUDA device "
              f"(built with CUDA {torch.version.cuda})")
        return 2
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), {torch.cuda.device_count()} x "
          f"{torch.cuda.get_device_name(0)}")
    return 0


def make_input(directory, seq, batch, out):
    config = json.load(open(f"{directory}/config.json"))
    vocab = config["vocab_size"]
    rows = [[(101 + 7919 * (b * seq + s)) % (vocab - 1000) + 1000 if vocab > 2000 else 1 + (b * seq + s) % (vocab - 1)
             for s in range(seq)] for b in range(batch)]
    json.dump({"input_ids": rows, "attention_mask": [[1] * seq for _ in rows],
               "token_type_ids": [[0] * seq for _ in rows]}, open(out, "w"))
    return 0


def hf_model(directory, dtype):
    import torch
    from transformers import BertModel
    model = BertModel.from_pretrained(directory).to(device=DEVICE, dtype=torch_dtype(torch, dtype)).eval()
    return model


def hf_inputs(path):
    import torch
    j = json.load(open(path))
    t = {k: torch.tensor(j[k], device=DEVICE) for k in ("input_ids", "attention_mask", "token_type_ids") if k in j}
    return t


def parity(directory, input_path, ours_path, dtype):
    import torch
    from safetensors.torch import load_file
    model = hf_model(directory, dtype)
    with torch.no_grad():
        out = model(**hf_inputs(input_path))
    ours = load_file(ours_path)
    worst = 0.0
    for name in ("last_hidden_state", "pooler_output"):
        if name not in ours:
            print(f"parity {dtype}: our output has no {name} (has {sorted(ours)})")
            return 1
        want = getattr(out, name).float().cpu()
        got = ours[name].float()
        if tuple(got.shape) != tuple(want.shape):
            print(f"parity {dtype}: {name} is {tuple(got.shape)}, HF's {tuple(want.shape)}")
            return 1
        diff = (got - want).abs().max().item() / max(1.0, want.abs().max().item())
        worst = max(worst, diff)
        print(f"parity {dtype}: {name} {tuple(got.shape)} largest difference {diff:.2e} (relative)")
    ok = worst <= TOLERANCE[dtype]
    print(f"parity {dtype}: {'PASS' if ok else 'FAIL'} (tolerance {TOLERANCE[dtype]:g})")
    return 0 if ok else 1


def throughput(directory, input_path, dtype, iterations):
    import torch
    model = hf_model(directory, dtype)
    inputs = hf_inputs(input_path)
    rows = inputs["input_ids"].shape[0]
    result = {}
    for name, fn in (("eager", model), ("compile", torch.compile(model))):
        with torch.no_grad():
            for _ in range(3):  # warm-up (and compilation)
                fn(**inputs)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(iterations):
                fn(**inputs)
            torch.cuda.synchronize()
        result[name] = rows * iterations / (time.perf_counter() - start)
    print(json.dumps(result))
    return 0


def main(argv):
    if len(argv) < 2:
        print(__doc__)
        return 2
    command, args = argv[1], argv[2:]
    if command == "probe":
        return probe()
    if command == "input":
        return make_input(args[0], int(args[1]), int(args[2]), args[3])
    if command == "parity":
        return parity(*args)
    if command == "throughput":
        return throughput(args[0], args[1], args[2], int(args[3]))
    print(f"unknown subcommand {command}\n{__doc__}")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
