#!/usr/bin/python3
"""Generates small BERT checkpoints and their expected outputs, independently of bertshard.

Run with Debian's python3-torch (`/usr/bin/python3 tests/testdata/model/gen_reference.py`); the
output is checked in, so tests do not need Python. The forward pass below is written from
HuggingFace transformers' BERT semantics (eval mode) with plain tensor ops -- no transformers, no
bertshard code -- so it is an independent reference for the C++ model:

  embeddings  LN(word[ids] + position[0..L-1] + token_type[tt])
  attention   softmax(q k^T / sqrt(d) + (1 - mask) * finfo.min) v, heads split from H as
              [nh, d] (head-major); decoders (BertLMHeadModel, is_decoder) add the causal mask
  layer       LN(dense(ctx) + x); LN(dense(act(dense(x1))) + x1)
  pooler      tanh(dense(h[:, 0]))
  LM head     decoder(LN(act(dense(h)))) + bias   (decoder tied to word embeddings if tied)
  heads       NSP, classifiers (pooled / per token), multiple choice ([B, C, L] -> [B, C]), QA.

Each case directory holds config.json, model.safetensors (HF layout; tied decoder weights are
not stored, as HF stores the tensor once), input.json and expected.safetensors (float32, HF output
names), computed in float64 and rounded to float32.
"""
import json
import math
import os
import struct

import torch

HERE = os.path.dirname(os.path.abspath(__file__))

BASE = dict(vocab_size=99, hidden_size=32, num_attention_heads=4, num_hidden_layers=4,
            intermediate_size=64, max_position_embeddings=16, type_vocab_size=2,
            layer_norm_eps=1e-12, hidden_act="gelu", tie_word_embeddings=True, num_labels=2,
            is_decoder=False, pad_token_id=0, model_type="bert")

# name, HF class, config overrides, checkpoint dtype
CASES = [
    ("bert_model", "BertModel", {}, "F32"),
    ("pretraining_tied", "BertForPreTraining", {"hidden_act": "gelu_new"}, "F32"),
    ("lm_head_decoder", "BertLMHeadModel", {"is_decoder": True, "hidden_act": "gelu_pytorch_tanh"}, "F32"),
    ("masked_lm_untied", "BertForMaskedLM", {"tie_word_embeddings": False, "hidden_act": "relu"}, "F32"),
    ("next_sentence", "BertForNextSentencePrediction", {}, "F32"),
    ("sequence_classification_f16", "BertForSequenceClassification", {"num_labels": 3}, "F16"),
    ("token_classification_bf16", "BertForTokenClassification", {"num_labels": 5}, "BF16"),
    ("multiple_choice", "BertForMultipleChoice", {}, "F32"),
    ("question_answering", "BertForQuestionAnswering", {}, "F32"),
]

HAS_POOLER = {"BertModel", "BertForPreTraining", "BertForNextSentencePrediction",
              "BertForSequenceClassification", "BertForMultipleChoice"}
LM = {"BertForPreTraining", "BertLMHeadModel", "BertForMaskedLM"}
TORCH_DTYPE = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def write_safetensors(path, tensors, dtype="F32"):
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        raw = _to_bytes(t.contiguous().to(TORCH_DTYPE[dtype]))
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def _to_bytes(t):
    if t.dtype == torch.float32:
        return t.numpy().tobytes()
    return t.view(torch.int16).numpy().tobytes()  # F16 / BF16 bit patterns, little-endian


def make_weights(variant, cfg, gen):
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    p = "" if variant == "BertModel" else "bert."
    w = {}

    def rnd(*shape, scale=0.2):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).float() * scale

    def linear(name, out_f, in_f):
        w[name + ".weight"] = rnd(out_f, in_f)
        w[name + ".bias"] = rnd(out_f, scale=0.1)

    def norm(name):
        w[name + ".weight"] = 1 + rnd(H, scale=0.1)
        w[name + ".bias"] = rnd(H, scale=0.1)

    w[p + "embeddings.word_embeddings.weight"] = rnd(V, H, scale=0.5)
    w[p + "embeddings.position_embeddings.weight"] = rnd(cfg["max_position_embeddings"], H, scale=0.5)
    w[p + "embeddings.token_type_embeddings.weight"] = rnd(cfg["type_vocab_size"], H, scale=0.5)
    norm(p + "embeddings.LayerNorm")
    for i in range(cfg["num_hidden_layers"]):
        l = f"{p}encoder.layer.{i}."
        for proj in ("query", "key", "value"):
            linear(l + "attention.self." + proj, H, H)
        linear(l + "attention.output.dense", H, H)
        norm(l + "attention.output.LayerNorm")
        linear(l + "intermediate.dense", I, H)
        linear(l + "output.dense", H, I)
        norm(l + "output.LayerNorm")
    if variant in HAS_POOLER:
        linear(p + "pooler.dense", H, H)
    if variant in LM:
        w["cls.predictions.bias"] = rnd(V, scale=0.1)
        linear("cls.predictions.transform.dense", H, H)
        norm("cls.predictions.transform.LayerNorm")
        if not cfg["tie_word_embeddings"]:
            w["cls.predictions.decoder.weight"] = rnd(V, H, scale=0.5)
    if variant in ("BertForPreTraining", "BertForNextSentencePrediction"):
        linear("cls.seq_relationship", 2, H)
    if variant in ("BertForSequenceClassification", "BertForTokenClassification"):
        linear("classifier", cfg["num_labels"], H)
    if variant == "BertForMultipleChoice":
        linear("classifier", 1, H)
    if variant == "BertForQuestionAnswering":
        linear("qa_outputs", 2, H)
    return w


def act(name, x):
    if name == "gelu":
        return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
    if name == "relu":
        return torch.clamp(x, min=0)
    raise ValueError(name)


def layer_norm(x, w, b, eps):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * w + b


def dense(x, w, name):
    return x @ w[name + ".weight"].T + w[name + ".bias"]


def forward(variant, cfg, w, ids, mask, tt, choices=1):
    p = "" if variant == "BertModel" else "bert."
    eps = cfg["layer_norm_eps"]
    B, L = ids.shape
    H, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    d = H // nh
    x = (w[p + "embeddings.word_embeddings.weight"][ids]
         + w[p + "embeddings.position_embeddings.weight"][torch.arange(L)]
         + w[p + "embeddings.token_type_embeddings.weight"][tt])
    x = layer_norm(x, w[p + "embeddings.LayerNorm.weight"], w[p + "embeddings.LayerNorm.bias"], eps)
    m = mask.float()
    if cfg["is_decoder"]:
        causal = (torch.arange(L)[None, :] <= torch.arange(L)[:, None]).float()
        m3 = causal[None, :, :] * m[:, None, :]
        ext = (1.0 - m3[:, None, :, :]) * torch.finfo(torch.float32).min
    else:
        ext = (1.0 - m[:, None, None, :]) * torch.finfo(torch.float32).min
    for i in range(cfg["num_hidden_layers"]):
        l = f"{p}encoder.layer.{i}."

        def heads(t):
            return t.view(B, L, nh, d).permute(0, 2, 1, 3)

        q = heads(dense(x, w, l + "attention.self.query"))
        k = heads(dense(x, w, l + "attention.self.key"))
        v = heads(dense(x, w, l + "attention.self.value"))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d) + ext
        ctx = (torch.softmax(scores, dim=-1) @ v).permute(0, 2, 1, 3).reshape(B, L, H)
        x1 = layer_norm(dense(ctx, w, l + "attention.output.dense") + x,
                        w[l + "attention.output.LayerNorm.weight"], w[l + "attention.output.LayerNorm.bias"], eps)
        inter = act(cfg["hidden_act"], dense(x1, w, l + "intermediate.dense"))
        x = layer_norm(dense(inter, w, l + "output.dense") + x1,
                       w[l + "output.LayerNorm.weight"], w[l + "output.LayerNorm.bias"], eps)
    out = {}
    pooled = torch.tanh(dense(x[:, 0], w, p + "pooler.dense")) if variant in HAS_POOLER else None

    def lm_logits(h):
        t = act(cfg["hidden_act"], dense(h, w, "cls.predictions.transform.dense"))
        t = layer_norm(t, w["cls.predictions.transform.LayerNorm.weight"], w["cls.predictions.transform.LayerNorm.bias"], eps)
        dec = w.get("cls.predictions.decoder.weight", w[p + "embeddings.word_embeddings.weight"])
        return t @ dec.T + w["cls.predictions.bias"]

    if variant == "BertModel":
        out["last_hidden_state"] = x
        out["pooler_output"] = pooled
    elif variant == "BertForPreTraining":
        out["prediction_logits"] = lm_logits(x)
        out["seq_relationship_logits"] = dense(pooled, w, "cls.seq_relationship")
    elif variant in ("BertLMHeadModel", "BertForMaskedLM"):
        out["logits"] = lm_logits(x)
    elif variant == "BertForNextSentencePrediction":
        out["logits"] = dense(pooled, w, "cls.seq_relationship")
    elif variant == "BertForSequenceClassification":
        out["logits"] = dense(pooled, w, "classifier")
    elif variant == "BertForTokenClassification":
        out["logits"] = dense(x, w, "classifier")
    elif variant == "BertForMultipleChoice":
        out["logits"] = dense(pooled, w, "classifier").view(-1, choices)
    elif variant == "BertForQuestionAnswering":
        logits = dense(x, w, "qa_outputs")
        out["start_logits"] = logits[..., 0]
        out["end_logits"] = logits[..., 1]
    return out


def main():
    for index, (name, variant, overrides, dtype) in enumerate(CASES):
        cfg = dict(BASE, **overrides)
        cfg["architectures"] = [variant]
        gen = torch.Generator().manual_seed(1000 + index)
        w = make_weights(variant, cfg, gen)
        # What a checkpoint of this dtype holds, read back in fp32: the reference uses exactly that.
        w = {k: v.to(TORCH_DTYPE[dtype]).float() for k, v in w.items()}
        B, L = 2, 8
        choices = 2 if variant == "BertForMultipleChoice" else 1
        ids = torch.randint(1, cfg["vocab_size"], (B * choices, L), generator=gen)
        ids[0, 1] = cfg["vocab_size"] - 1  # the last real vocabulary row (next to the padding)
        mask = torch.ones(B * choices, L, dtype=torch.long)
        mask[-1, 5:] = 0  # a padded example
        ids[-1, 5:] = 0
        tt = torch.zeros(B * choices, L, dtype=torch.long)
        tt[:, 4:] = 1
        # The forward in float64, rounded to float32 once at the end: the exact answer for these
        # weights, so the tests' 1e-5 measures the C++ model's own rounding rather than the sum of
        # its rounding and a float32 reference's.
        out = forward(variant, cfg, {k: v.double() for k, v in w.items()}, ids, mask, tt, choices)
        directory = os.path.join(HERE, name)
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
        write_safetensors(os.path.join(directory, "model.safetensors"), w, dtype)
        shape = (B, choices, L) if choices > 1 else (B, L)
        inputs = {"input_ids": ids.view(shape).tolist(), "attention_mask": mask.view(shape).tolist(),
                  "token_type_ids": tt.view(shape).tolist()}
        with open(os.path.join(directory, "input.json"), "w") as f:
            json.dump(inputs, f)
        write_safetensors(os.path.join(directory, "expected.safetensors"),
                          {k: v.float() for k, v in out.items()})
        print(name, {k: list(v.shape) for k, v in out.items()})


if __name__ == "__main__":
    main()
