#!/usr/bin/env bash
# tests/cli_chat: `kvlm chat` end to end on stories260K (greedy, python3 stdlib, a few
# seconds). Three turns through stdin:
#   - turns 2 and 3 take all but the new message's tokens from the cache (at least the
#     tokens the cache held after the turn before, less 2 for a retokenized boundary);
#   - each answer equals the one --no-kv-cache gives (every token recomputed), and the
#     one `kvlm run` gives for the conversation rendered by this script (the plain
#     template: "User: ...\nAssistant: ...\n" ending with "Assistant:");
# then: a context too small for four turns leaves the oldest out (and says so) and still
# answers each; a message longer than the context is left out with a message and the
# next one answered; /reset starts over; a line ending with a backslash goes on;
# --history with --kv-disk: a conversation reopened in a new process takes its cache
# back from the disk tier and answers as one process does (/reset empties the history;
# a bad history line is refused); --json begins a new object every turn; a bad option
# and --kv-evict are refused.
set -uo pipefail
KVLM="${KVLM_BIN:?KVLM_BIN must point at the kvlm binary}"
MODELS="${KVLM_MODELS:-${KVLM_MODELS_DEFAULT:-../shared/models}}"
MODEL="$MODELS/stories260K.gguf"
if [ ! -f "$MODEL" ]; then echo "SKIP: $MODEL not found (set KVLM_MODELS)"; exit 77; fi
exec timeout -k 5 300 python3 - "$KVLM" "$MODEL" <<'PY'
import re, subprocess, sys

kvlm, model = sys.argv[1], sys.argv[2]
failures = 0

def check(cond, name, detail=""):
    global failures
    print(("ok   " if cond else "FAIL ") + name + ("" if cond else " " + str(detail)), flush=True)
    failures += 0 if cond else 1

TURN = re.compile(r"\[turn (\d+): (\d+) prompt tokens, (\d+) from the cache, (\d+) prefilled .*"
                  r"answer: (\d+) tokens.*KV cache: (\d+) tokens")

def chat(lines, *args):
    p = subprocess.run([kvlm, "chat", "-m", model, "--temp", "0", "-t", "1"] + list(args),
                       input="".join(l + "\n" for l in lines), capture_output=True, text=True, timeout=120)
    turns = [tuple(map(int, m.groups())) for m in TURN.finditer(p.stderr)]
    return p.returncode, p.stdout.split("\n")[:-1], turns, p.stderr

users = ["Tell me a story about a cat.", "What did the cat eat?", "And then what happened?"]
rc, answers, turns, err = chat(users, "-n", "24")
check(rc == 0 and len(answers) == 3 and len(turns) == 3, "three turns, three answers", (rc, answers, err[-300:]))
if len(turns) == 3:
    check(turns[0][2] == 0, "turn 1 takes nothing from the cache")
    for k in (1, 2):
        prev_kv, (_, n, cached, prefilled, _, _) = turns[k - 1][5], turns[k]
        check(cached >= prev_kv - 2 and cached + prefilled == n and prefilled < n // 2,
              "turn %d: %d of %d prompt tokens from the cache (the cache held %d), %d prefilled"
              % (k + 1, cached, n, prev_kv, prefilled))

rc2, answers2, turns2, _ = chat(users, "-n", "24", "--no-kv-cache")
check(rc2 == 0 and answers2 == answers and all(t[2] == 0 for t in turns2),
      "--no-kv-cache (nothing reused, every token recomputed) gives the same answers", (answers2, answers))

# kvlm run on the conversation as the plain template renders it
convo = ""
for k, u in enumerate(users):
    convo += "User: %s\nAssistant:" % u
    p = subprocess.run([kvlm, "run", "-m", model, "--temp", "0", "-t", "1", "-n", "24", "--special", "-p", convo],
                       capture_output=True, text=True, timeout=60)
    out = p.stdout.rstrip("\n")
    got = out[len(convo):] if out.startswith(convo) else None
    check(k < len(answers) and got is not None and got.split("\nUser:")[0] == answers[k],
          "turn %d's answer is kvlm run's for the rendered conversation" % (k + 1),
          (got, answers[k] if k < len(answers) else None))
    if k < len(answers): convo += " " + answers[k].strip() + "\n"

# a small context: the oldest turns go, each turn is answered
rc, ans, turns, err = chat(users + ["Where is the cat now?"], "-n", "16", "-c", "96")
check(rc == 0 and len(ans) == 4 and len(turns) == 4 and all(t[4] > 0 for t in turns)
      and all(t[1] <= 96 - 16 for t in turns) and "oldest turns left out" in err,
      "-c 96: four answers, each prompt within 80 tokens, the oldest turns left out", (len(ans), turns, err[-300:]))

# too long a message, /reset, a continued line
long = "the cat sat on the mat " * 40
rc, ans, turns, err = chat([long, "Hello there.", "/reset", "One more \\", "line."], "-n", "8", "-c", "96")
check(rc == 0 and "left out" in err and len(ans) == 2 and len(turns) == 2,
      "a message longer than the context is left out; the next ones are answered", (ans, err[-300:]))
reset_turns, reset_err = turns, err
rc, ans, turns, err = chat(["One more \\", "line."], "-n", "8")
check("starts over" in reset_err and len(reset_turns) == 2 and turns and reset_turns[1][1] == turns[0][1]
      and reset_turns[1][2] < reset_turns[0][5] // 2,
      "/reset starts the conversation over: the next prompt is a fresh conversation's %d tokens, of which "
      "the cache still has the template's first few" % (turns[0][1] if turns else -1), (reset_turns, turns))
rc_b, ans_b, turns_b, _ = chat(["One more\nline."], "-n", "8")  # two messages: compare the first turn's size
check(rc == 0 and len(turns) == 1 and len(turns_b) == 2 and turns[0][1] > turns_b[0][1],
      "a line ending with a backslash goes on on the next one (one message of %d tokens)"
      % (turns[0][1] if turns else -1))

# --history with --kv-disk: a conversation closed after two turns and opened again in a
# new process takes its cache back from the disk tier (all its full blocks), and its
# third answer is the one a single process gives
import os, tempfile
tmp = tempfile.mkdtemp()
hist, disk = os.path.join(tmp, "h.txt"), os.path.join(tmp, "kv")
one = chat(users, "-n", "24", "--system", "Be kind.")
first = chat(users[:2], "-n", "24", "--system", "Be kind.", "--history", hist, "--kv-disk", disk)
lines = open(hist).read().split("\n")
check(first[0] == 0 and [l.split(":")[0] for l in lines[:5]] == ["system", "user", "assistant", "user", "assistant"]
      and lines[5:] == [""], "--history writes the system message and each turn, one a line", lines)
again = chat(users[2:], "-n", "24", "--history", hist, "--kv-disk", disk)
held = first[2][-1][5] if first[2] else 0
check(again[0] == 0 and len(again[2]) == 1 and again[2][0][2] >= held // 16 * 16 - 16 and again[2][0][2] > 0,
      "reopened: its first turn takes %s of %s prompt tokens from the disk tier (the first process held %d)"
      % (again[2][0][2] if again[2] else "?", again[2][0][1] if again[2] else "?", held), (again[2], again[3][-300:]))
check(len(one[1]) == 3 and again[1] == one[1][2:], "and answers as one process does at its third turn", (again[1], one[1]))
chat(["/reset"], "--history", hist)
check(open(hist).read() == "system: Be kind.\n", "/reset leaves the history its system message alone")
with open(hist, "w") as f: f.write("user: fine\nwizard: no\n")
bad = chat(["Hi"], "--history", hist)
check(bad[0] != 0 and "line 2" in bad[3], "a history line of no known role is refused with its number", bad[3][-200:])

# --json: each answer is a JSON object of its own (the grammar starts afresh every turn)
jh = os.path.join(tmp, "json.txt")
rc, _, turns, err = chat(["one", "two"], "-n", "30", "--json", "--history", jh)
said = [l[len("assistant: "):] for l in open(jh).read().split("\n") if l.startswith("assistant: ")]
check(rc == 0 and len(said) == 2 and all(a.startswith("{") for a in said),
      "--json: each turn's answer begins an object of its own", (said, err[-200:]))

# sliding windows (random-weight gemma2 and a llama with every layer local, window 8,
# blocks of 4): a turn cannot cut the sequence back past blocks the window gave
# back (refused), so it starts over from the prefix index; the answers stay the
# recomputed ones
for arch, extra in (("gemma2", ["--layers", "4", "--tied", "--seed", "9"]), ("llama", ["--layers", "2", "--seed", "5"])):
    path = os.path.join(tmp, arch + ".gguf")
    subprocess.run([kvlm, "synth", path, "--arch", arch, "--dim", "64", "--heads", "4", "--kv-heads", "2", "--hidden", "128",
                    "--sliding-window", "8"] + extra, capture_output=True, timeout=60)
    def chat_m(m, *args):
        p = subprocess.run([kvlm, "chat", "-m", m, "--temp", "0", "-t", "1", "--block-size", "4", "-n", "16"] + list(args),
                           input="hello there\nhow are you\nand then\n", capture_output=True, text=True, timeout=60)
        return p.returncode, p.stdout, [tuple(map(int, x.groups())) for x in TURN.finditer(p.stderr)], p.stderr
    a, b = chat_m(path), chat_m(path, "--no-kv-cache")
    check(a[0] == 0 and b[0] == 0 and a[1] == b[1] and len(a[2]) == 3 and a[2][2][2] > 0,
          "%s with a window of 8: three answers equal the recomputed ones (%s tokens from the cache at turn 3)"
          % (arch, a[2][2][2] if len(a[2]) == 3 else "?"), (a[0], a[3][-300:], a[1], b[1]))

p = subprocess.run([kvlm, "chat", "-m", model, "--kv-evict", "sinks", "--kv-budget", "64"], input="",
                   capture_output=True, text=True, timeout=30)
check(p.returncode != 0 and "--kv-evict" in p.stderr, "--kv-evict is refused with a message", p.stderr[-200:])
p = subprocess.run([kvlm, "chat", "-m", model, "--nope"], input="", capture_output=True, text=True, timeout=30)
check(p.returncode != 0 and "unknown option" in p.stderr, "an unknown option is refused", p.stderr[-200:])
print("cli_chat: %s" % ("all passed" if not failures else "%d failed" % failures))
sys.exit(1 if failures else 0)
PY
