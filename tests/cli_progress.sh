#!/usr/bin/env bash
# tests/cli_progress: the progress lines of long work (synth, convert, a model's load,
# perplexity's time left) show on a terminal and stay out of piped output:
#   - piped (stderr to a file): synth writes nothing on stderr, convert only its "wrote"
#     line, run and perplexity only their usual lines: no carriage return, no escape;
#     the files written are byte for byte those of a run on a terminal;
#   - on a terminal (script(1) gives the process one): "writing F:  NN%" lines redrawn in
#     place, their percentages never going down, ending at 100%, the line cleared after;
#     perplexity prints its "s per chunk ... left" line before the values;
#   - KVLM_PROGRESS=0 keeps a terminal quiet; KVLM_PROGRESS=1 shows it piped (the
#     model load's "loading" line, from 0% to 100%).
set -uo pipefail
KVLM="${KVLM_BIN:?KVLM_BIN must point at the kvlm binary}"
MODELS="${KVLM_MODELS:-${KVLM_MODELS_DEFAULT:-../shared/models}}"
CORPORA="${KVLM_CORPORA:-${KVLM_CORPORA_DEFAULT:-../shared/corpora}}"
MODEL="$MODELS/stories260K.gguf"
TEXT="$CORPORA/tinystories-valid-head.txt"
[ -f "$MODEL" ] || { echo "SKIP: $MODEL not found (set KVLM_MODELS)"; exit 77; }
[ -f "$TEXT" ] || { echo "SKIP: $TEXT not found (set KVLM_CORPORA)"; exit 77; }
command -v script >/dev/null || { echo "SKIP: script (util-linux) not found"; exit 77; }
exec timeout -k 5 200 python3 - "$KVLM" "$MODEL" "$TEXT" <<'PY'
import os, re, shlex, subprocess, sys, tempfile

kvlm, model, text_path = sys.argv[1:4]
quick = bool(os.environ.get("KVLM_TEST_QUICK"))
failures = 0
def check(cond, name, detail=""):
    global failures
    print(("ok   " if cond else "FAIL ") + name + ("" if cond else " " + repr(detail)[-500:]), flush=True)
    failures += 0 if cond else 1

tmp = tempfile.mkdtemp(prefix="kvlm_progress_")
env0 = {k: v for k, v in os.environ.items() if k != "KVLM_PROGRESS"}

def piped(args, env=None):
    p = subprocess.run([kvlm] + args, capture_output=True, text=True, timeout=150, env=env or env0)
    return p.returncode, p.stdout, p.stderr

def tty(args, env=None):
    """args run with a terminal for stdin, stdout and stderr (script -q): what the terminal showed."""
    log = os.path.join(tmp, "typescript")
    cmd = " ".join(shlex.quote(a) for a in [kvlm] + args)
    p = subprocess.run(["script", "-qfec", cmd, log], stdin=subprocess.DEVNULL, capture_output=True, timeout=150,
                       env=env or env0)
    return p.returncode, p.stdout.decode("utf-8", "replace")

def percents(screen, what):
    return [int(x) for x in re.findall(re.escape(what) + r":\s+(\d+)%", screen)]

def clean(text):
    return "\r" not in text and "\x1b" not in text

# a model whose writing takes a moment (about 1.5 s here): longer than the 0.3 s before a line shows
shape = ["--dim", "512", "--layers", "16", "--heads", "8", "--hidden", "1536", "--vocab", "4000", "--type", "q4_0"]
a, b, c = (os.path.join(tmp, n) for n in ("a.gguf", "b.gguf", "c.gguf"))
rc, out, err = piped(["synth", a] + shape)
check(rc == 0 and out == "" and err == "", "synth piped: nothing on stdout or stderr", err)
rc, screen = tty(["synth", b] + shape)
p = percents(screen, "writing " + b)
check(rc == 0 and p and p == sorted(p) and p[-1] == 100 and screen.rstrip("\r\n").endswith("\x1b[K"),
      "synth on a terminal: 'writing' %s%% ... 100%%, redrawn in place, cleared after" % p[:1], screen[-300:])
check(open(a, "rb").read() == open(b, "rb").read(), "the same file either way")
rc, screen = tty(["synth", c] + shape, dict(env0, KVLM_PROGRESS="0"))
check(rc == 0 and clean(screen) and screen.strip() == "", "KVLM_PROGRESS=0: the terminal stays quiet", screen[-200:])

rc, out, err = piped(["convert", a, c, "--type", "q8_0"])
check(rc == 0 and out == "" and err == "kvlm convert: wrote %s\n" % c, "convert piped: only its 'wrote' line", err)
# (shown from the start: a quick machine converts this model in less than the 0.3 s before a line shows;
# synth above checks that a terminal turns the line on by itself)
rc, screen = tty(["convert", a, b, "--type", "q8_0"], dict(env0, KVLM_PROGRESS="1"))
p = percents(screen, "writing %s as q8_0" % b)
check(rc == 0 and p and p == sorted(p) and p[-1] == 100 and ("kvlm convert: wrote %s" % b) in screen,
      "convert on a terminal: 'writing ... as q8_0' up to 100%, then its line", screen[-300:])
check(open(b, "rb").read() == open(c, "rb").read(), "the same file either way")

# a model load's line, forced through a pipe (a small model loads faster than a line shows)
rc, out, err = piped(["run", "-m", a, "-p", "Hi", "-n", "2", "--temp", "0"], dict(env0, KVLM_PROGRESS="1"))
p = percents(err, "loading a.gguf")
check(rc == 0 and p and p[0] == 0 and p[-1] == 100 and p == sorted(p), "KVLM_PROGRESS=1: 'loading a.gguf' 0% .. 100%",
      err[-300:])
rc, out, err = piped(["run", "-m", model, "-p", "Once", "-n", "4", "--temp", "0"])
check(rc == 0 and clean(err) and re.fullmatch(r"prompt tokens: \d+ \| prefill: [^\n]*\n", err), "run piped: its one line",
      err)

text = os.path.join(tmp, "t.txt")
with open(text_path, encoding="utf-8", errors="replace") as f:
    open(text, "w").write(f.read(8000 if quick else 24000))
rc, out, err = piped(["perplexity", "-m", model, "-f", text, "-c", "128"])
lines = err.splitlines()
check(rc == 0 and clean(err) and clean(out) and len(lines) == 2 and lines[0].startswith("perplexity: ")
      and lines[1].startswith("perplexity: ") and "left" not in err and "Final estimate: PPL = " in out,
      "perplexity piped: its two stderr lines, no time left", err)
rc, screen = tty(["perplexity", "-m", model, "-f", text, "-c", "128"])
check(rc == 0 and re.search(r"perplexity: [0-9.]+ s per chunk, \d+ chunks: about \d+ min \d\d s left\r?\n\[1\]", screen)
      is not None, "perplexity on a terminal: the time left before the first value", screen[:400])
subprocess.run(["rm", "-rf", tmp])
print("%d failed" % failures)
sys.exit(1 if failures else 0)
PY
