#!/usr/bin/python3
"""Real sentences as `shardctl run --input` JSON, tokenised with a checkpoint's own vocab.txt.

BERT's uncased WordPiece for plain ASCII English: lower-case, split on whitespace and punctuation,
greedy longest-match-first word pieces ("##" continuations), [CLS] ... [SEP], padded with [PAD] to
the longest sentence (attention_mask 0 there). Enough for the fixed English sentences below; the
project's own tokenizer (tokenizer/) serves everything else. Used by bench/suite.sh's real-model
step (bf16 vs fp32 on all-MiniLM-L6-v2).

  wordpiece_inputs.py --vocab DIR/vocab.txt --out input.json
"""
import argparse
import json
import string

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A sharded BERT model should give the same answers as the unsharded one.",
    "Tensor parallelism splits each layer's matrices across several devices.",
    "Pipeline stages pass activations to the next stage, one micro-batch at a time.",
    "How many parameters does the base model have?",
    "Paris is the capital and most populous city of France.",
    "She sells sea shells by the sea shore, or so the story goes.",
    "Numbers like 3.14159 and 2026 are split into word pieces too.",
]


def wordpiece(word, vocab):
    pieces, start = [], 0
    while start < len(word):
        end = len(word)
        while end > start:
            piece = word[start:end] if start == 0 else "##" + word[start:end]
            if piece in vocab:
                pieces.append(piece)
                break
            end -= 1
        if end == start:
            return ["[UNK]"]
        start = end
    return pieces


def tokens(text, vocab):
    out = ["[CLS]"]
    word = ""
    for ch in text.lower() + " ":
        if ch.isspace() or ch in string.punctuation:
            if word:
                out += wordpiece(word, vocab)
            word = ""
            if ch in string.punctuation:
                out += wordpiece(ch, vocab)
        else:
            word += ch
    return out + ["[SEP]"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    with open(a.vocab, encoding="utf-8") as f:
        vocab = {line.rstrip("\n"): i for i, line in enumerate(f)}
    ids = [[vocab[t] for t in tokens(s, vocab)] for s in SENTENCES]
    seq = max(len(x) for x in ids)
    with open(a.out, "w") as f:
        json.dump({"input_ids": [x + [vocab["[PAD]"]] * (seq - len(x)) for x in ids],
                   "attention_mask": [[1] * len(x) + [0] * (seq - len(x)) for x in ids],
                   "token_type_ids": [[0] * seq for _ in ids]}, f)


if __name__ == "__main__":
    main()
