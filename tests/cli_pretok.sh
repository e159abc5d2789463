#!/usr/bin/env bash
# tests/cli_pretok: every pre-tokenizer llama.cpp knows, as `kvlm tokenize
# --pre NAME --chunks` splits text, against the same regex lists run by
# Python's `regex` module (llama.cpp's lists, transcribed here on their own),
# on the shared corpora, hand-written strings and random Unicode strings.
set -uo pipefail
KVLM="${KVLM_BIN:?KVLM_BIN must point at the kvlm binary}"
CORPORA="${KVLM_CORPORA:-${KVLM_CORPORA_DEFAULT:-../shared/corpora}}"
MODELS="${KVLM_MODELS:-${KVLM_MODELS_DEFAULT:-../shared/models}}"
PY=/usr/bin/python3
if [ ! -x "$PY" ] || ! "$PY" -c 'import regex' 2>/dev/null; then
  echo "SKIP: /usr/bin/python3 with the regex module (Debian python3-regex, scripts/setup.sh) is missing" >&2
  exit 77
fi
exec "$PY" - "$KVLM" "$CORPORA" "$MODELS" <<'PYEOF'
import os, random, subprocess, sys, tempfile, unicodedata
import regex

kvlm, corpora, models = sys.argv[1], sys.argv[2], sys.argv[3]

# ---- llama.cpp's regex lists per tokenizer.ggml.pre (llama-vocab.cpp) -------------------
CONTR = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = CONTR + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2 = CONTR + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
DS3_MAIN = "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
HAN_KANA = "[一-龥぀-ゟ゠-ヿ]+"
DS_CJK = "[一-龥ࠀ-一가-퟿]+"
# (Five letters of this class are written as escapes: copied as text they
# would be NFC-normalised into other code points.)
DS_LETTERS = ("A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝ"
              "Ὗ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳ"
              "Ꙁ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃")
BLOOM = " ?[^(\\s|.,!?…。，、।۔،)]+"
def cased(num):
    return (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + CONTR +
            r"?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + CONTR + "?|" + num +
            r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
def case_approx(cls, contr, num):
    up, lo = "((?=[%s])([^a-z]))" % cls, "((?=[%s])([^A-Z]))" % cls
    return (r"[^\r\n\p{L}\p{N}]?" + up + "*" + lo + "+" + contr + r"|[^\r\n\p{L}\p{N}]?" + up + "+" + lo + "*" +
            contr + "|" + num + r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

def afmoe_digits(piece):
    # llama.cpp's \p{AFMoE_digits} code: digit runs, the first group takes
    # len % 3, then threes.
    out = []
    for m in regex.finditer(r"\p{N}+|[^\p{N}]+", piece):
        s = m.group()
        if not regex.match(r"\p{N}", s):
            out.append(s)
            continue
        r = len(s) % 3
        if r:
            out.append(s[:r])
        out.extend(s[i:i + 3] for i in range(r, len(s), 3))
    return out

KIMI = (r"[\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}--\p{Han}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}--\p{Han}]+" +
        CONTR + r"?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}--\p{Han}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}--\p{Han}]*" +
        CONTR + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

TABLE = [
    (["default"], [r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"]),
    (["gpt-2", "gpt2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
      "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "exaone4", "mpt", "olmo", "jais", "trillion",
      "granite-docling"], [GPT2]),
    (["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano",
      "dbrx", "smaug-bpe", "glm4", "chatglm-bpe"], [LLAMA3]),
    (["jais-2"], [CONTR + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s{512}(?!\S)"
                  r"|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)"
                  r"|\s{1,2}(?!\S)|\s{1}"]),
    (["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open", "grok-2"],
     [QWEN2]),
    (["qwen35"], [CONTR + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
                  r"|\s+(?!\S)|\s+"]),
    (["starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"],
     [r"\p{N}", GPT2]),
    (["falcon"], [r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]"]),
    (["deepseek-llm"], ["[\r\n]", "\\s?[" + DS_LETTERS + "]+", "\\s?[!-/:-~！-／：-～‘-‟　-。]+", r"\s+\Z", DS_CJK,
                        r"\p{N}+"]),
    (["deepseek-coder"], ["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", DS_CJK, r"\p{N}"]),
    (["deepseek-v3", "hunyuan-dense", "hy_v4", "joyai-llm"],
     [r"\p{N}{1,3}", HAN_KANA, DS3_MAIN + "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"]),
    (["spark2_5"], [r"\p{N}{1,3}", HAN_KANA, DS3_MAIN + "| ?[\\p{P}\\p{S}]+|[\r\n]|\\s+(?!\\S)|\\s+", r"\p{N}"]),
    (["youtu"], ["[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥぀-ゟ゠-ヿ]+", cased(r"\p{N}")]),
    (["afmoe"], [afmoe_digits, "[一-鿿㐀-䶿\uf900-﫿぀-ゟ゠-ヿ･-ﾟ⼀-⿟เ-๿຀-໿ក-៿က-႟ꩠ-ꩿꧠ-꧿가-힯ᄀ-ᇿ]+",
                 DS3_MAIN + "| ?[\\p{P}\\p{S}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"]),
    (["bloom", "gpt3-finnish", "poro-chat"], [BLOOM]),
    (["viking"], [BLOOM, r"\p{N}"]),
    (["tekken"], [case_approx(r"\p{L}", "", r"\p{N}")]),
    (["chameleon"], ["<sentinel:[0-9]+>", "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", "([\\t\\n]|    |  )", r"\p{N}",
                     r"[\p{P}!-/:-@\[-`{-~]", GPT2]),
    (["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], [case_approx(r"\p{L}", CONTR + "?", r"\p{N}{1,3}")]),
    (["granite-embed-multi-97m"], [case_approx(r"\p{L}\p{M}", CONTR + "?", r"\p{N}{1,3}")]),
    (["tiny_aya", "cohere2moe"], [r"\d{1,3}(?=(?:\d{3})*\b)", cased(r"\p{N}{1,3}")]),
    (["kimi-k2"], [regex.compile(KIMI, regex.V1)]),
    (["superbpe"], [r"\p{N}+", r"(?=(\d{3})+(?!\d))"]),
    (["bailingmoe", "bailingmoe2", "llada-moe"],
     [r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
      r"|\s*[\r\n]|\s+(?!\S)|\s+"]),
    (["seed-coder"], [CONTR + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"]),
    (["ufakzeka"], [r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"]),
    (["laguna"], [r"[^\n]+|[\n]+", QWEN2]),
    (["exaone-moe"], [CONTR + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?"
                      r"|\s*[\r\n]|\s+(?!\S)|\s+"]),
    (["minicpm5"], [r"\p{N}{1,3}", CONTR + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                    r"|\s+(?!\S)|\s+"]),
    (["gemma4", "granite-embed-multi-311m", "sarvam-moe"], [r"[^\n]+|[\n]+"]),
    (["whitespace"], [r"\S+"]),
]

def split(text, regs):
    pieces = [text]
    for r in regs:
        if isinstance(r, str):
            r = regex.compile(r)
        out = []
        for p in pieces:
            if callable(r) and not hasattr(r, "finditer"):
                out.extend(x for x in r(p) if x)
                continue
            pos = 0
            for m in r.finditer(p):
                s, e = m.span()
                if s > pos:
                    out.append(p[pos:s])
                    pos = s
                if e > s:
                    out.append(p[s:e])
                    pos = e
            if pos < len(p):
                out.append(p[pos:])
        pieces = out
    return pieces

def unescape(line):
    assert line.startswith('"') and line.endswith('"'), line
    b, out, i = line[1:-1].encode("utf-8"), bytearray(), 0
    while i < len(b):
        c = b[i]
        if c != 0x5C:
            out.append(c); i += 1; continue
        d = chr(b[i + 1])
        if d == "x":
            out.append(int(b[i + 2:i + 4], 16)); i += 4; continue
        out.append({"n": 10, "r": 13, "t": 9, "\\": 92, '"': 34}[d]); i += 2
    return bytes(out)

def kvlm_chunks(name, path, model=None):
    how = ["-m", model] if model else ["--pre", name]
    r = subprocess.run([kvlm, "tokenize"] + how + ["--chunks", "-f", path], capture_output=True)
    if r.returncode != 0:
        return None, r.stderr.decode(errors="replace").strip()
    lines = r.stdout.decode("utf-8").split("\n")
    assert lines[-1] == ""
    return [unescape(l).decode("utf-8") for l in lines[:-1]], ""

# ---- the text ------------------------------------------------------------------------------
HAND = [
    "Hello, world!! 12345 x", "I'M don't we'LL it's x'sy Ankara'da", "1234567 apples abc1234 1234x 1234567",
    "HelloWorld ABCdef HELLOworld ÀÉÎ caf\u00e9 cafe\u0301", "你好世界，很好！ 안녕하세요 こんにちは カタカナ ㄅㄆ",
    "a  b   c    d\t\te\n\n\nf \n g\r\nh", "x;\ny/\nz", "<sentinel:12>IMGIMGABZ IMGIMGAAAAAZ", ".hello x.\u00e9t\u00e9",
    "Привет мир! Γειά σου κόσμε", "\u3000\u3000x\u00a0y\u2009z\u180e!\u0085\u2028", "a+b=`c` ~x~ $5 ^_^ |pipe|",
    "😀👍🏽 🇫🇷 e\u0301\u0301", "٠١٢٣ ²³ ⅧⅫ ١٢٣٤", "ſt Kelvin ﬁne", "(x) [y] {z} …。，、।۔،",
    "Hello big world!\nx  y", " " * 40 + "x" + "\n" * 5 + " " * 600 + "y",
]
def random_strings(n, seed):
    rnd = random.Random(seed)
    pool = list(" \n\t\r'.,!?()`~$+<>/_-\"") + list("aehtTHZsM0123") + [chr(c) for c in (
        0x4F60, 0x597D, 0xAC00, 0x3042, 0x30AB, 0x3000, 0x3002, 0xFF01, 0x2026, 0x301, 0xE9, 0xC9, 0x410, 0x430,
        0x5D0, 0x627, 0x964, 0xE01, 0x661, 0xB2, 0x2167, 0x1F600, 0xA0, 0x2009, 0x180E, 0x85, 0x2028, 0x17F,
        0x212A, 0xFB01, 0x10400, 0x3105, 0x1100, 0x1780)]
    out = []
    for _ in range(n):
        s = []
        for _ in range(rnd.randint(1, 30)):
            if rnd.random() < 0.15:
                while True:
                    c = chr(rnd.randint(0x20, 0x2FFFF))
                    # characters PCRE2 (Unicode 14) and this Python (unicodedata) know alike
                    if unicodedata.category(c) not in ("Cn", "Cs"):
                        break
                s.append(c)
            else:
                s.append(rnd.choice(pool))
        out.append("".join(s))
    return out

parts = list(HAND) + random_strings(3000, 1234)
for name, cap in (("wiki.test.raw", 120000), ("tinystories-valid-head.txt", 40000)):
    p = os.path.join(corpora, name)
    if os.path.exists(p):
        parts.append(open(p, encoding="utf-8", errors="replace").read()[:cap])
    else:
        print("note: %s not found; hand-written and random strings only" % p)
text = "\n".join(parts)
fd, path = tempfile.mkstemp(suffix=".txt")
os.write(fd, text.encode("utf-8"))
os.close(fd)

# ---- compare ---------------------------------------------------------------------------------
failed = passed = 0
known = set()
for names, regs in TABLE:
    want = split(text, regs)
    assert "".join(want) == text
    for name in names:
        known.add(name)
        got, err = kvlm_chunks(name, path)
        if got is None:
            failed += 1
            print("FAIL %s: kvlm refused it: %s" % (name, err))
            continue
        if got == want:
            passed += 1
            continue
        failed += 1
        i = next((k for k in range(min(len(got), len(want))) if got[k] != want[k]), min(len(got), len(want)))
        print("FAIL %s: %d chunks, want %d; first difference at chunk %d:\n  got  %r\n  want %r"
              % (name, len(got), len(want), i, got[max(0, i - 3):i + 4], want[max(0, i - 3):i + 4]))
# A model's own pre-tokenizer (tokenizer.ggml.pre "gpt-2") through -m.
vocab = os.path.join(models, "vocab", "ggml-vocab-gpt-2.gguf")
if os.path.exists(vocab):
    got, err = kvlm_chunks(None, path, vocab)
    if got == split(text, [GPT2]):
        passed += 1
    else:
        failed += 1
        print("FAIL -m %s --chunks: %s" % (vocab, err or "chunks differ from GPT-2's"))
else:
    print("note: %s not found; -m MODEL --chunks not checked" % vocab)
print("ok   %d checks (every name; -m MODEL) on %d bytes of text (%d chunks for gpt-2)" % (passed, len(text.encode()), len(split(text, [GPT2]))))

# Every kind kvlm lists when refusing a name is one llama.cpp knows, and
# the refusal lists what is supported.
r = subprocess.run([kvlm, "tokenize", "--pre", "no-such-pre", "--chunks", "x"], capture_output=True)
msg = r.stderr.decode()
if r.returncode == 0 or "no-such-pre" not in msg or "supported:" not in msg:
    failed += 1
    print("FAIL unknown name: rc %d, %r" % (r.returncode, msg))
else:
    listed = msg.split("supported:")[1].split(" and their aliases")[0].split(", ")
    extra = [n.strip() for n in listed if n.strip() not in known]
    if extra:
        failed += 1
        print("FAIL kvlm lists pre-tokenizers this test does not know: %s" % extra)
os.unlink(path)
print("%d passed, %d failed" % (passed, failed))
sys.exit(1 if failed else 0)
PYEOF
