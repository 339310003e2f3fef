#!/usr/bin/env python3
"""Token-for-token parity of tokenizer/wordpiece.cc with HuggingFace `tokenizers` (the fast BertTokenizer).

Run by tokenizer_parity_test.sh with the HF venv's python (tools/requirements-hf.txt: tokenizers
0.19.1, transformers 4.40.2). Texts go through tokenize_tool (the C++ tokenizer) and through
transformers' BertTokenizerFast built from the same vocab.txt, and for every text these must be equal:
  - ids: [CLS] ... [SEP], compared id for id;
  - words: what is left before WordPiece (HF's normalizer + pre-tokenizer, special tokens cut out of
    the raw text first, as HF's added-token matching does), so that no difference hides behind [UNK];
  - decoded: tokenizer.decode(ids, skip_special_tokens=True).
A failure prints the first differing texts (repr) of each kind with both sides, and then fails.

Configurations, each with its own vocabulary (--uncased_vocab, --cased_vocab; the output names the
file, its size and sha256 for each):
  - uncased: tests/testdata/vocab/bert-base-uncased-vocab.txt, do_lower_case=True, strip_accents
    unset, so accents stripped (bert-base-uncased's settings);
  - cased: tests/testdata/vocab/bert-base-cased-vocab.txt (the real bert-base-cased vocabulary,
    tests/testdata/vocab/README.md), do_lower_case=False, strip_accents unset, so not stripped
    (bert-base-cased's settings, as BertTokenizerFast has them for it);
  - lower (lower-casing without stripping) and strip (stripping without lower-casing), for the
    generated texts and every code point, with the uncased vocabulary.
The uncased and cased configurations see the same texts: the fortune entries, the generated edge
cases, truncation, decoding, and the ids and decoding of every code point (besides its words in
cased and its normalised form in uncased).

Texts:
  1. Real text: entries of Debian's fortune databases - the '%'-separated entries of every regular
     file the packages install under /usr/share/games/fortunes (dpkg-query -L), whole, with their
     newlines, tabs and terminal escapes. Entries installed (Debian 12, duplicates removed) and
     compared (a seeded sample of 2,000 per language, 12,000 in all; --per_language changes it):
       fortunes + fortunes-min (English) 15,134   fortunes-de (German)   18,651
       fortunes-es (Spanish)             12,004   fortunes-it (Italian)   8,505
       fortunes-ru (Russian)             20,178   fortunes-zh (Chinese)   5,661
     All these files are UTF-8; one that is not would be skipped with a message (which legacy
     encoding it uses cannot be told reliably). Fewer than 10,000 entries in all fails the test.
  2. Generated edge cases (about 5,000): every character of categories Zs, Zl, Zp, Cc and Cf and
     of the White_Space property in several contexts; private-use, unassigned, noncharacter and
     recently assigned samples; lower-casing corner cases (İ, ı, final sigma, ß/ẞ, ligatures, title
     case, Kelvin/Ohm signs, Deseret); accents in NFC and NFD and stacked marks in several orders;
     CJK at the edges of HF's ranges, Hangul, kana, full-width forms; emoji with ZWJ sequences, skin
     tones, flags and keycaps; punctuation runs; words of 99 to 1000 characters (before and after
     accent stripping); special tokens inside words, misspelt, lower-cased, next to controls; and
     3,000 seeded random mixtures of all of these.
  3. Every Unicode code point (surrogates aside) between two letters, 256 to a text: the words in
     the cased configuration (cleaning and splitting of each character), the normalised characters
     in the others (accent stripping and lower-casing of each character); and in the uncased and
     cased configurations the ids and decoded text of every code point through the vocabulary,
     alone and between two letters.
  4. Truncation (truncation=True): single texts at max_length 2..512; pairs of every length split
     up to 8 + 8 tokens and of real texts, where ids and token types must equal HF's and `truncated`
     must say whether HF cut anything.

Also reported, never asserted: where the slow Python BertTokenizer disagrees with the fast one, on
300 entries per language and on the generated texts (it differs on purpose: its Unicode tables are
Python's, the fast one's are older; the fast one is the reference the C++ tokenizer follows).
"""

import argparse
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
import unicodedata

os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import transformers  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from transformers import BertTokenizer, BertTokenizerFast  # noqa: E402

transformers.logging.set_verbosity_error()

SPECIALS = ["[MASK]", "[CLS]", "[SEP]", "[PAD]", "[UNK]"]
SPECIAL_RE = re.compile("(" + "|".join(re.escape(s) for s in SPECIALS) + ")")
PACKAGES = [("en", ["fortunes", "fortunes-min"]), ("de", ["fortunes-de"]), ("es", ["fortunes-es"]),
            ("it", ["fortunes-it"]), ("ru", ["fortunes-ru"]), ("zh", ["fortunes-zh"])]
MIN_REAL = 10000
SHOW = 10


def log(*args):
    print(*args, flush=True)


# ----------------------------------------------------------------------------------------------
# Texts


def fortune_corpus():
    """{language: [entries]} from the installed fortune packages."""
    corpus = {}
    for lang, packages in PACKAGES:
        entries, seen = [], set()
        for package in packages:
            listing = subprocess.run(["dpkg-query", "-L", package], capture_output=True, text=True)
            if listing.returncode != 0:
                sys.exit(f"FAILED: Debian package {package} is not installed (tools/install_deps.sh installs it)")
            for path in sorted(listing.stdout.split()):
                if (not path.startswith("/usr/share/games/fortunes/") or path.endswith(".dat")
                        or os.path.islink(path) or not os.path.isfile(path)):
                    continue
                raw = open(path, "rb").read()
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    log(f"note: skipping {path}: not UTF-8 ({e})")
                    continue
                for entry in re.split(r"^%$", text, flags=re.M):
                    entry = entry.strip("\n")
                    if entry.strip() and entry not in seen:
                        seen.add(entry)
                        entries.append(entry)
        corpus[lang] = entries
    return corpus


def generated_texts():
    texts = []
    cats = {}
    for cp in range(0x110000):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        cats.setdefault(unicodedata.category(chr(cp)), []).append(cp)
    white_space = [0x9, 0xA, 0xB, 0xC, 0xD, 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029,
                   0x202F, 0x205F, 0x3000, *range(0x1C, 0x20), 0x180E, 0x200B, 0xFEFF]
    separators_and_controls = sorted(set(cats["Zs"] + cats["Zl"] + cats["Zp"] + cats["Cc"] + cats["Cf"] + white_space))
    for cp in separators_and_controls:
        c = chr(cp)
        texts += [f"a{c}b", c, f"x {c} y", f"A{c}\u0301B", f"{c}[MASK]{c}", f"中{c}文", f"don{c}'t", f"{c}{c}{c}"]
    samples = [0xE000, 0xF8FF, 0xF0000, 0xFFFFD, 0x100000, 0x10FFFD,  # private use
               0x0378, 0x0379, 0x0530, 0x0890, 0x08E2, 0x1AC1, 0x2E55, 0x2E5D, 0x11938, 0x1E4EC, 0x31350,
               0xFDD0, 0xFDEF, 0xFFFE, 0xFFFF, 0x1FFFE, 0x10FFFF, 0xFFFD, 0xFFFC, 0x0]  # unassigned, new, non-chars
    for cp in samples:
        c = chr(cp)
        texts += [f"a{c}b", c, f"x {c} y", f"É{c}é", f"{c}."]
    texts += [
        # lower-casing
        "İstanbul DİYARBAKIR ıi Iı", "ΣΑΣ ΟΔΟΣ Σ. ΌΣΟΣ ς σ", "ΣΑΣ", "Straße STRASSE ẞ ß", "ﬁ ﬂ ﬀ ﬃ ﬄ ﬅ ﬆ ﬁne",
        "Ǆ ǅ ǆ ǈ ǋ ǲ", "\u2126 \u212A \u212B Ω K Å", "𐐀𐐨 𐐁", "Ꭰ ꭰ ᏸ", "ᲐᲑᲒ აბგ", "Ⅻ ⅻ Ⓐ ⓐ", "ＡＢＣ ａｂｃ １２３！？",
        "ǰ ẖ ẗ ẘ ẙ ẚ ŉ", "ΐ ΰ ᾳ ᾼ ῼ", "և Ա", "MAKE AMERICA ÉÈÊ", "I\u0307 i\u0307",
        # accents, NFC / NFD, stacked marks
        "naïve café résumé Ångström crème brûlée", "nai\u0308ve cafe\u0301 re\u0301sume\u0301",
        "Tiếng Việt có dấu", "Tie\u0302\u0301ng Vie\u0323\u0302t",
        "a\u0301\u0323 a\u0323\u0301 a\u0323\u0301\u0307\u0338",
        "e\u0301\u0301\u0301\u0301", "\u0301\u0302 leading marks", "ḋ\u0323 ḍ\u0307 d\u0323\u0307 d\u0307\u0323",
        "हिन्दी मराठी", "العَرَبِيَّة", "עִבְרִית", "ภาษาไทย", "각 한국어 가각", "Ελληνικά άέήίόύώ",
        "Ǖǘǚǜ ǖ", "ﬀ\u0301", "\u1734\u1AC1\u0890 new marks", "\U00011935\U00011930 \U00011938",
        # CJK and friends
        "中文字符测试", "日本語のテキスト、カタカナ。", "漢字かなカナ", "\u3400\u4DBF\u4E00\u9FFF\uF900\uFAFF",
        "\U00020000\U0002A6DF\U0002A700\U0002B73F\U0002B740\U0002B81F\U0002B820\U0002B91F\U0002B920\U0002CEAF"
        "\U0002CEB0\U0002EBE0\U00030000\U00031350\U0002F800\U0002FA1F",
        "abc中def", "中.文!", "\u2F00\u2F01 \u31C0 \u3005\u3007", "한국어 텍스트입니다",
        # emoji
        "😀 😃 🥰 🫨 🫠", "👍🏽 👍🏻 👍🏿", "👨\u200d👩\u200d👧\u200d👦 family", "🏳\ufe0f\u200d🌈 🏴\u200d☠\ufe0f",
        "🇫🇷🇩🇪 🇺🇸", "1\ufe0f\u20e3 #\ufe0f\u20e3", "hello😀world", "☃ ★ ♥ ✓", "x\ufe0fy",
        # punctuation runs
        "...!!!?!", "—–-‒―", "«quoted» „so“ ‚so‘ “double” 'single'", "¡¿Qué?!", "(((x)))[[y]]{{z}}",
        "$%^&*@#~`|\\/<>", "___---+++===", "a.b,c;d:e", "I don't think it's 5'6\" tall.", "... .. .",
        "e.g. i.e. U.S.A.", "§¶†‡•‰′″", "〈〉《》「」『』【】〔〕", "।॥", "⸕⸗⸺⸻", "a--b---c", "'tis 'twas ' '",
        # long words
        "a" * 99, "a" * 100, "a" * 101, "a" * 1000, "é" * 100, "é" * 101, "e\u0301" * 60, "e\u0301" * 100,
        "supercalifragilisticexpialidocious" * 3, "x" * 100 + "." + "y" * 101, "中" * 150,
        "ab" * 50 + "\u00ad" + "ab", "Ա" * 101, "Σ" * 101, "İ" * 60, "ﬁ" * 101,
        # special tokens
        "[CLS]", "[SEP] inside", "x[MASK]y", "[mask] [Mask]", "[MASK", "MASK]", "[[MASK]]", "[UNK][UNK]",
        "[PAD]", "[ MASK ]", "[MASK]\u0301", "\u0000[MASK]", "[MA\u200bSK]", "[unused0] [unused1]",
        "[CLS][SEP][PAD][MASK][UNK]", "the [MASK] sat on the [MASK].", "[SEP]\u2028[SEP]", "ＭＡＳＫ [ＭＡＳＫ]",
        "[MASK][MASK][MASK]", "a[CLS]b[SEP]c", "[", "]", "[]", "[MASKED]", "[UNKNOWN]",
        # whitespace only and empty
        "", " ", "\t\n\r", "\u3000", "\u2028", "a\u2028b\u2029c", "\n\n\nx\n\n", "\u00a0\u00a0", "\x00",
        "\ufffd", "\x00\ufffd\x00", "\x0b\x0c\x85", "line1\nline2\r\nline3\rline4",
    ]
    # Seeded random mixtures of everything above.
    rng = random.Random(20240611)
    pools = [
        [chr(c) for c in range(0x21, 0x7F)] * 4,
        [chr(c) for c in separators_and_controls],
        [chr(c) for c in cats["Mn"][:400]] + [chr(c) for c in cats["Mc"][:100]] + [chr(c) for c in cats["Me"]],
        [chr(c) for c in range(0xC0, 0x250)] + [chr(c) for c in range(0x370, 0x530)],
        [chr(c) for c in [*range(0x4E00, 0x4E80), *range(0x3040, 0x3100), *range(0xAC00, 0xAC80)]],
        [chr(c) for c in cats["Po"] + cats["Ps"] + cats["Pe"] + cats["Pd"] + cats["Pi"] + cats["Pf"] + cats["Pc"]],
        [chr(c) for c in cats["Co"][:50] + cats["Cn"][:200] + cats["Cn"][-50:]],
        ["😀", "👍", "🏽", "\u200d", "\ufe0f", "🇫", "🇷", "👨", "👩"],
        SPECIALS + ["[mask]", "[", "]"],
        [" "] * 5,
    ]
    for _ in range(3000):
        n = rng.randint(1, 40)
        texts.append("".join(rng.choice(rng.choice(pools)) for _ in range(n)))
    return texts


def every_code_point_texts():
    """(first, last, text): 256 code points at a time, each between two letters."""
    cps = [cp for cp in range(0x110000) if not 0xD800 <= cp <= 0xDFFF]
    return [(cps[i], cps[min(i + 256, len(cps)) - 1], " ".join(f"a{chr(cp)}b" for cp in cps[i:i + 256]))
            for i in range(0, len(cps), 256)]


# ----------------------------------------------------------------------------------------------
# The two sides


class Config:
    def __init__(self, name, vocab, lower, strip):
        self.name, self.vocab, self.lower, self.strip = name, vocab, lower, strip

    def vocab_sha256(self):
        with open(self.vocab, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()

    def describe(self):
        with open(self.vocab, "rb") as f:
            lines = f.read().count(b"\n")
        strip = "unset (follows do_lower_case)" if self.strip is None else self.strip
        return (f"{self.name}: vocab {os.path.basename(self.vocab)} ({lines} tokens, sha256 {self.vocab_sha256()}), "
                f"do_lower_case={self.lower}, strip_accents={strip}")

    def tool_flags(self):
        strip = "" if self.strip is None else ("true" if self.strip else "false")
        return [f"--do_lower_case={'true' if self.lower else 'false'}", f"--strip_accents={strip}"]

    def hf_kwargs(self):
        return {"do_lower_case": self.lower, "strip_accents": self.strip}


class ToolRun:
    """tokenize_tool over `requests`, in the background (HF works meanwhile on the other core)."""

    def __init__(self, tool, vocab, config, requests):
        self.n = len(requests)
        self.started = time.time()
        data = "".join(json.dumps(r) + "\n" for r in requests).encode()
        self.proc = subprocess.Popen([tool, f"--vocab={vocab}", *config.tool_flags()], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.result = None
        self.thread = threading.Thread(target=self._run, args=(data,))
        self.thread.start()

    def _run(self, data):
        self.result = self.proc.communicate(data)
        self.seconds = time.time() - self.started

    def wait(self):
        self.thread.join()
        stdout, stderr = self.result
        if self.proc.returncode != 0:
            sys.exit(f"FAILED: tokenize_tool exited {self.proc.returncode}: {stderr.decode(errors='replace')}")
        out = [json.loads(line) for line in stdout.decode().split("\n")[:-1]]  # not splitlines: U+2028
        if len(out) != self.n:
            sys.exit(f"FAILED: tokenize_tool answered {len(out)} lines for {self.n}")
        return out


def hf_words(backend, text):
    words = []
    for i, segment in enumerate(SPECIAL_RE.split(text)):
        if i % 2:
            words.append(segment)
        elif segment:
            normal = backend.normalizer.normalize_str(segment)
            words += [w for w, _ in backend.pre_tokenizer.pre_tokenize_str(normal)]
    return words


def hf_decode(fast, ids_list):
    """transformers' BertTokenizerFast.decode(ids, skip_special_tokens=True) for many: its _decode is
    the backend's decode followed by clean_up_tokenization (clean_up_tokenization_spaces is True)."""
    assert fast.clean_up_tokenization_spaces
    texts = fast.backend_tokenizer.decode_batch(ids_list, skip_special_tokens=True)
    return [fast.clean_up_tokenization(t) for t in texts]


def window(seq, i, width=6):
    lo = max(0, i - width)
    return ("... " if lo else "") + repr(seq[lo:i + width]) + (" ..." if i + width < len(seq) else "")


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def show_text(text):
    return repr(text) if len(text) <= 300 else repr(text[:300]) + f"... ({len(text)} characters)"


# What each configuration compared, for the summary: {config name: ["what count", ...]}.
COMPARED = {}


def tally(config, what):
    COMPARED.setdefault(config.name, []).append(what)


class Mismatches:
    def __init__(self):
        self.count = {}
        self.shown = {}

    def add(self, what, text, hf, ours, tokens=None):
        self.count[what] = self.count.get(what, 0) + 1
        if self.shown.setdefault(what, 0) >= SHOW:
            return
        self.shown[what] += 1
        i = first_difference(hf, ours) if isinstance(hf, list) and isinstance(ours, list) else 0
        if tokens is not None:
            hf = [tokens[x] if 0 <= x < len(tokens) else x for x in hf]
            ours = [tokens[x] if 0 <= x < len(tokens) else x for x in ours]
        shown = show_text(text) if isinstance(text, str) else repr(text)
        log(f"MISMATCH [{what}] {shown}")
        if isinstance(hf, list):
            log(f"    HF:   {window(hf, i)} (first difference at {i}; {len(hf)} in all)")
            log(f"    ours: {window(ours, i)} ({len(ours)} in all)")
        else:
            log(f"    HF:   {hf!r}\n    ours: {ours!r}")


def vocab_tokens(fast):
    return [t for t, _ in sorted(fast.vocab.items(), key=lambda kv: kv[1])]


def compare(tool, config, texts, label, mismatches, slow_sample=()):
    """ids, words and decoded text of every text."""
    vocab = config.vocab
    t0 = time.time()
    run = ToolRun(tool, vocab, config, [{"text": t} for t in texts])
    fast = BertTokenizerFast(vocab, **config.hf_kwargs())
    tokens = vocab_tokens(fast)
    hf_ids = fast(texts)["input_ids"]
    hf_decoded = hf_decode(fast, hf_ids)
    backend = fast.backend_tokenizer
    hf_all_words = [hf_words(backend, t) for t in texts]
    ours = run.wait()
    for text, o, ids, words, decoded in zip(texts, ours, hf_ids, hf_all_words, hf_decoded):
        if "error" in o:
            mismatches.add(f"{config.name}: tool error", text, "", o["error"])
            continue
        if o["ids"] != ids:
            mismatches.add(f"{config.name}: ids", text, ids, o["ids"], tokens)
        if o["words"] != words:
            mismatches.add(f"{config.name}: words", text, words, o["words"])
        if o["decoded"] != decoded:
            mismatches.add(f"{config.name}: decode", text, decoded, o["decoded"])
    tally(config, f"{label} {len(texts)}")
    log(f"  {config.name:>7} {label}: {len(texts)} texts, ids/words/decode compared in {time.time() - t0:.1f}s "
        f"(tokenize_tool {run.seconds:.1f}s)")
    if slow_sample:
        report_slow(vocab, config, texts, slow_sample, hf_ids, tokens, label)


def report_slow(vocab, config, texts, sample, hf_ids, tokens, label):
    t0 = time.time()
    slow = BertTokenizer(vocab, **config.hf_kwargs())
    differ = [(i, s) for i in sample for s in [slow(texts[i])["input_ids"]] if s != hf_ids[i]]
    log(f"  {config.name:>7} {label}: the slow BertTokenizer differs from the fast one on {len(differ)} of "
        f"{len(sample)} texts ({time.time() - t0:.1f}s; reported, not asserted)")
    seen = set()  # one example per kind of difference: the first differing tokens
    for i, s in differ:
        j = first_difference(hf_ids[i], s)
        fast_tokens, slow_tokens = [tokens[x] for x in hf_ids[i]], [tokens[x] for x in s]
        kind = (tuple(fast_tokens[j:j + 1]), tuple(slow_tokens[j:j + 1]))
        if kind in seen or len(seen) >= 8:
            continue
        seen.add(kind)
        log(f"      {show_text(texts[i])}\n        fast: {window(fast_tokens, j)}"
            f"\n        slow: {window(slow_tokens, j)}")


def compare_every_code_point(tool, config, chunks, mismatches, full_words):
    """Words (full_words) or just the normalised characters of the every-code-point texts."""
    vocab = config.vocab
    t0 = time.time()
    texts = [text for _, _, text in chunks]
    run = ToolRun(tool, vocab, config, [{"text": t} for t in texts])
    backend = BertTokenizerFast(vocab, **config.hf_kwargs()).backend_tokenizer
    if full_words:
        expected = [hf_words(backend, t) for t in texts]
    else:
        # Splitting into words is checked with full_words; here what the normaliser makes of each
        # character under this configuration's lower-casing and accent stripping.
        expected = ["".join(backend.normalizer.normalize_str(t).split(" ")) for t in texts]
    what = f"{config.name}: every code point, {'words' if full_words else 'normalised characters'}"
    for (first, last, text), o, e in zip(chunks, run.wait(), expected):
        ours = o.get("words", []) if full_words else "".join(o.get("words", []))
        if "error" in o or ours != e:
            mismatches.add(what, f"U+{first:04X}..U+{last:04X}, each as 'a?b'", e, o.get("error", ours))
    tally(config, f"every code point {len(texts)} texts ({'words' if full_words else 'normalised characters'})")
    log(f"  {config.name:>7} every code point: {len(texts)} texts of 256, "
        f"{'words' if full_words else 'normalised characters'} compared in {time.time() - t0:.1f}s")


def compare_every_code_point_ids(tool, config, chunks, mismatches):
    """Ids and decoded text of every code point through this configuration's vocabulary: each
    character alone (a word-initial piece) and between two letters (a '##' piece after 'a', unless
    it is split off), 256 to a text."""
    vocab = config.vocab
    t0 = time.time()
    texts, where = [], []
    for first, last, text in chunks:
        texts.append(text)
        where.append(f"U+{first:04X}..U+{last:04X}, each as 'a?b'")
        # The same code points, each alone between spaces.
        texts.append(" ".join(chr(cp) for cp in range(first, last + 1) if not 0xD800 <= cp <= 0xDFFF))
        where.append(f"U+{first:04X}..U+{last:04X}, each alone")
    run = ToolRun(tool, vocab, config, [{"text": t} for t in texts])
    fast = BertTokenizerFast(vocab, **config.hf_kwargs())
    tokens = vocab_tokens(fast)
    hf_ids = fast(texts)["input_ids"]
    hf_decoded = hf_decode(fast, hf_ids)
    for w, o, ids, decoded in zip(where, run.wait(), hf_ids, hf_decoded):
        if "error" in o:
            mismatches.add(f"{config.name}: every code point, tool error", w, "", o["error"])
            continue
        if o["ids"] != ids:
            mismatches.add(f"{config.name}: every code point, ids", w, ids, o["ids"], tokens)
        if o["decoded"] != decoded:
            mismatches.add(f"{config.name}: every code point, decode", w, decoded, o["decoded"])
    tally(config, f"every code point {len(texts)} texts (ids, decode)")
    log(f"  {config.name:>7} every code point: {len(texts)} texts of 256 (alone and as 'a?b'), ids and decode "
        f"compared in {time.time() - t0:.1f}s")


def compare_truncation(tool, config, corpus, mismatches):
    """truncation=True: single texts and pairs, synthetic lengths and real texts."""
    vocab = config.vocab
    t0 = time.time()
    fast = BertTokenizerFast(vocab, **config.hf_kwargs())
    tokens = vocab_tokens(fast)
    rng = random.Random(7)
    singles = [t for entries in corpus.values() for t in rng.sample(entries, min(50, len(entries)))]
    singles += ["", "a", "a b", "[MASK]", "中文字符测试 " * 30]
    # Every split of the room: segments of n1 and n2 one-token words, max_length 3..n1+n2+3.
    pairs = [(" ".join(["a"] * n1), " ".join(["b"] * n2), ml)
             for n1 in range(9) for n2 in range(9) for ml in range(3, n1 + n2 + 4)]
    # Real pairs. HF builds every overflow combination of a pair, so long texts only get a large limit.
    short = [t for t in singles if len(fast.tokenize(t)) <= 12]
    pairs += [(rng.choice(short), rng.choice(short), ml) for ml in (3, 4, 5, 8, 11, 16, 24) for _ in range(12)]
    pairs += [(rng.choice(singles), rng.choice(singles), ml) for ml in (64, 128, 512) for _ in range(25)]
    pairs += [(t, t, 9) for t in short[:20]]  # ties
    requests, expected = [], []
    for ml in (2, 3, 4, 5, 7, 8, 16, 31, 32, 64, 128, 512):
        full = fast(singles)["input_ids"]
        cut = fast(singles, truncation=True, max_length=ml)
        for t, f, ids, types in zip(singles, full, cut["input_ids"], cut["token_type_ids"]):
            requests.append({"text": t, "max_length": ml, "truncation": True})
            expected.append(((t, ml), ids, types, len(f) > ml))
    # Pairs go to the tokenizers library itself: transformers drops an empty second text
    # (`if text_pair`), tokenizers (and ours) encode it as [CLS] a [SEP] [SEP].
    backend = Tokenizer.from_str(fast.backend_tokenizer.to_str())
    backend.no_truncation()  # the copy keeps what transformers last set up
    full = backend.encode_batch([(a, b) for a, b, _ in pairs])
    by_limit = {}
    for (a, b, ml), f in zip(pairs, full):
        by_limit.setdefault(ml, []).append((a, b, len(f.ids) > ml))
    for ml, group in sorted(by_limit.items()):
        # What transformers' truncation=True sets up (TruncationStrategy.LONGEST_FIRST, right side).
        backend.enable_truncation(ml, stride=0, strategy="longest_first", direction="right")
        for (a, b, was_cut), e in zip(group, backend.encode_batch([(a, b) for a, b, _ in group])):
            requests.append({"text": a, "pair": b, "max_length": ml, "truncation": True})
            expected.append(((a, b, ml), e.ids, e.type_ids, was_cut))
    ours = ToolRun(tool, vocab, config, requests).wait()
    n_cut = 0
    for (what, ids, types, was_cut), o in zip(expected, ours):
        label = f"{config.name}: truncation"
        if "error" in o:
            mismatches.add(label, what, "", o["error"])
        elif o["ids"] != ids:
            mismatches.add(label, what, ids, o["ids"], tokens)
        elif o["type_ids"] != types:
            mismatches.add(label + " token types", what, types, o["type_ids"])
        elif o["truncated"] != was_cut:
            mismatches.add(label + " flag", what, was_cut, o["truncated"])
        n_cut += was_cut
    tally(config, f"truncation {len(requests)} encodings ({len(pairs)} pairs)")
    log(f"  {config.name:>7} truncation: {len(requests)} encodings ({n_cut} cut, {len(pairs)} pairs) compared in "
        f"{time.time() - t0:.1f}s")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tool", required=True, help="tokenize_tool")
    parser.add_argument("--uncased_vocab", required=True, help="bert-base-uncased's vocab.txt")
    parser.add_argument("--cased_vocab", required=True, help="bert-base-cased's vocab.txt")
    parser.add_argument("--per_language", type=int, default=2000, help="fortune entries per language")
    parser.add_argument("--slow_sample", type=int, default=300, help="of those, how many the slow tokenizer sees")
    args = parser.parse_args()
    t0 = time.time()
    log(f"transformers {transformers.__version__}, tokenizers {__import__('tokenizers').__version__}")

    corpus = fortune_corpus()
    rng = random.Random(1)
    real, slow_sample = [], []
    for lang, entries in corpus.items():
        picked = rng.sample(entries, min(args.per_language, len(entries)))
        slow_sample += range(len(real), len(real) + min(args.slow_sample, len(picked)))
        real += picked
    log("fortune entries (installed / compared): "
        + ", ".join(f"{lang} {len(v)}/{min(args.per_language, len(v))}" for lang, v in corpus.items())
        + f"; {len(real)} compared")
    if len(real) < MIN_REAL:
        sys.exit(f"FAILED: only {len(real)} fortune entries (need {MIN_REAL}); are the fortune packages installed?")
    generated = generated_texts()
    chunks = every_code_point_texts()
    log(f"generated edge cases: {len(generated)}; every code point: {len(chunks)} texts")

    mismatches = Mismatches()
    uncased = Config("uncased", args.uncased_vocab, True, None)
    cased = Config("cased", args.cased_vocab, False, None)
    lower = Config("lower", args.uncased_vocab, True, False)
    strip = Config("strip", args.uncased_vocab, False, True)
    configs = (uncased, cased, lower, strip)
    for config in configs:
        log("configuration " + config.describe())
    if cased.vocab_sha256() == uncased.vocab_sha256():
        sys.exit("FAILED: the cased configuration was given the uncased vocabulary")
    for config in (uncased, cased):
        compare(args.tool, config, real, "fortunes", mismatches, slow_sample)
        compare(args.tool, config, generated, "generated", mismatches, range(len(generated)))
        compare_truncation(args.tool, config, corpus, mismatches)
    for config in (lower, strip):
        compare(args.tool, config, generated, "generated", mismatches)
    # Each character's cleaning and splitting (cased: nothing else happens to it), accent stripping
    # and lower-casing on their own, and both (uncased).
    compare_every_code_point(args.tool, cased, chunks, mismatches, full_words=True)
    for config in (strip, lower, uncased):
        compare_every_code_point(args.tool, config, chunks, mismatches, full_words=False)
    # And what each vocabulary makes of every code point, word-initial and as a continuation.
    for config in (uncased, cased):
        compare_every_code_point_ids(args.tool, config, chunks, mismatches)

    log(f"done in {time.time() - t0:.1f}s; compared:")
    for config in configs:
        log(f"  {config.name} ({os.path.basename(config.vocab)}): " + ", ".join(COMPARED.get(config.name, [])))
    if mismatches.count:
        log("FAILED: " + ", ".join(f"{n} {what}" for what, n in mismatches.count.items()))
        return 1
    log("PASSED: token for token equal to HF tokenizers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
