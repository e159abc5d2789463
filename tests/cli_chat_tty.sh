#!/usr/bin/env bash
# tests/cli_chat_tty: `kvlm chat` at a terminal, driven through tmux (send-keys,
# capture-pane) on stories260K, greedy, answers without an end (-n -1 --ignore-eos):
#   - Ctrl-C mid-answer stops it: its turn line says "stopped at Ctrl-C", the process goes
#     on to the next prompt, and the partial answer joins the conversation (--history shows
#     it, as llama-cli keeps what was said);
#   - the second turn still takes the whole first turn from the cache (its "from the cache"
#     count is at least what the cache held after turn 1, less 2 for a retokenized edge);
#   - line editing (libedit): Left, Left, X makes "abc" "aXbc"; Up brings it back; the lines
#     typed are in --input-history FILE;
#   - Ctrl-C at the prompt quits with 130; two Ctrl-C in a row mid-answer quit too;
#   - -n larger than the context: said once at the start, and the turn line names the cut.
set -uo pipefail
KVLM="${KVLM_BIN:?KVLM_BIN must point at the kvlm binary}"
MODELS="${KVLM_MODELS:-${KVLM_MODELS_DEFAULT:-../shared/models}}"
MODEL="$MODELS/stories260K.gguf"
if [ ! -f "$MODEL" ]; then echo "SKIP: $MODEL not found (set KVLM_MODELS)"; exit 77; fi
command -v tmux >/dev/null || { echo "SKIP: tmux not found (scripts/setup.sh installs it)"; exit 77; }
CACHE="$(dirname "$KVLM")/CMakeCache.txt"
EDIT=0
[ -f "$CACHE" ] && grep -q '^LIBEDIT_FOUND:INTERNAL=1' "$CACHE" && EDIT=1
exec timeout -k 5 150 python3 - "$KVLM" "$MODEL" "$EDIT" <<'PY'
import os, re, shlex, subprocess, sys, tempfile, time

kvlm, model, edit = sys.argv[1], os.path.abspath(sys.argv[2]), sys.argv[3] == "1"
failures = 0
tmp = tempfile.mkdtemp(prefix="kvlm_tty_")
sock = None
n_sock = 0

def check(cond, name, detail=""):
    global failures
    print(("ok   " if cond else "FAIL ") + name + ("" if cond else " " + str(detail)), flush=True)
    failures += 0 if cond else 1

def tmux(*args, check_rc=True):
    return subprocess.run(["tmux", "-S", sock] + list(args), capture_output=True, text=True, check=check_rc).stdout

def pane():
    # the whole history, wrapped lines joined
    return tmux("capture-pane", "-p", "-J", "-S", "-5000", "-t", "t", check_rc=False)

def wait_for(pred, what, timeout=20.0, step=0.02):
    end = time.time() + timeout
    while time.time() < end:
        text = pane()
        if pred(text):
            return text
        time.sleep(step)
    check(False, "waiting for " + what, pane()[-600:])
    return None

def at_prompt(text):
    lines = [l for l in text.split("\n") if l.strip()]
    return bool(lines) and lines[-1].rstrip() == ">"

TURN = re.compile(r"\[turn (\d+): (\d+) prompt tokens, (\d+) from the cache, (\d+) prefilled .*?answer: (\d+) tokens, "
                  r"[0-9.]+ tokens/s, stopped at (.*?) \| KV cache: (\d+) tokens")

def turns(text):
    return [(int(m.group(1)), int(m.group(2)), int(m.group(3)), int(m.group(5)), m.group(6), int(m.group(7)))
            for m in TURN.finditer(text)]

def start(args, name):
    global sock, n_sock
    n_sock += 1 # a server of its own each time (a killed one may still be going)
    sock = os.path.join(tmp, "tmux%d.sock" % n_sock)
    cmd = " ".join(shlex.quote(a) for a in [kvlm, "chat", "-m", model, "--temp", "0", "-t", "1"] + args)
    # the exit code stays on the screen after the process ends (the shell
    # around it outlives the Ctrl-C sent to the foreground group: trap)
    tmux("-f", "/dev/null", "new-session", "-d", "-s", "t", "-x", "220", "-y", "50",
         "sh -c 'trap : INT; %s; echo EXIT=$?; sleep 30'" % cmd.replace("'", "'\\''"))
    tmux("set-option", "-t", "t", "history-limit", "10000", check_rc=False)
    return wait_for(at_prompt, name + ": the first prompt")

def stop():
    if sock:
        tmux("kill-server", check_rc=False)

def answer_begun(line):
    # some text of the answer on the screen below the typed line
    def pred(text):
        i = text.rfind(line)
        return i >= 0 and len(text[i + len(line):].strip()) > 20
    return pred

try:
    hist = os.path.join(tmp, "convo.txt")
    ih = os.path.join(tmp, "lines.txt")
    if start(["-n", "-1", "--ignore-eos", "--history", hist, "--input-history", ih], "chat"):
        tmux("send-keys", "-t", "t", "Tell me a story.", "Enter")
        if wait_for(answer_begun("> Tell me a story."), "the first answer"):
            tmux("send-keys", "-t", "t", "C-c")
        text = wait_for(lambda t: len(turns(t)) >= 1 and at_prompt(t), "turn 1's line and the next prompt")
        t1 = turns(text or "")
        check(len(t1) == 1 and t1[0][4] == "Ctrl-C" and 0 < t1[0][3] < 1500,
              "Ctrl-C mid-answer stops it (turn 1: %s) and the next prompt comes" % (t1[:1],), (text or "")[-400:])
        tmux("send-keys", "-t", "t", "What happened next?", "Enter")
        if wait_for(answer_begun("> What happened next?"), "the second answer"):
            tmux("send-keys", "-t", "t", "C-c")
        text = wait_for(lambda t: len(turns(t)) >= 2 and at_prompt(t), "turn 2's line")
        t2 = turns(text or "")
        if len(t1) == 1 and len(t2) == 2:
            _, n2, cached2, _, why2, _ = t2[1]
            # the same two turns through a pipe, the first answer stopped by -n at the same
            # length: Ctrl-C leaves the conversation and the cache just as -n does
            ref = subprocess.run([kvlm, "chat", "-m", model, "--temp", "0", "-t", "1", "-n", str(t1[0][3]),
                                  "--ignore-eos"], input="Tell me a story.\nWhat happened next?\n",
                                 capture_output=True, text=True, timeout=60)
            r = turns(ref.stderr)
            check(cached2 > t1[0][1] and len(r) == 2 and (r[1][1], r[1][2]) == (n2, cached2),
                  "turn 2 takes turn 1 and its partial answer from the cache: %d of %d prompt tokens, as when -n %d "
                  "ends the first answer (%s)" % (cached2, n2, t1[0][3], r[1][1:3] if len(r) == 2 else r), t2)
            check(why2 == "Ctrl-C", "turn 2 stopped by Ctrl-C too", why2)
        convo = open(hist).read() if os.path.exists(hist) else ""
        answers = re.findall(r"^assistant: (.*)$", convo, re.M)
        check(len(answers) == 2 and all(len(a) > 0 for a in answers),
              "--history keeps both partial answers (the conversation goes on with them)", convo[-300:])
        if edit:
            tmux("send-keys", "-t", "t", "abc", "Left", "Left", "X", "Enter")
            if wait_for(answer_begun("> aXbc"), "the edited line's answer"):
                tmux("send-keys", "-t", "t", "C-c")
            wait_for(lambda t: len(turns(t)) >= 3 and at_prompt(t), "turn 3")
            tmux("send-keys", "-t", "t", "Up", "Enter")
            if wait_for(lambda t: t.count("> aXbc") >= 2 and answer_begun("> aXbc")(t), "Up's line answered"):
                tmux("send-keys", "-t", "t", "C-c")
            wait_for(lambda t: len(turns(t)) >= 4 and at_prompt(t), "turn 4")
            convo = open(hist).read() if os.path.exists(hist) else ""
            users = re.findall(r"^user: (.*)$", convo, re.M)
            check(users[2:] == ["aXbc", "aXbc"], "line editing: Left Left X gave 'aXbc'; Up gave it again", users)
        else:
            print("note: built without libedit: the line-editing checks are left out")
        tmux("send-keys", "-t", "t", "C-c")
        text = wait_for(lambda t: "EXIT=" in t, "the exit after Ctrl-C at the prompt")
        m = re.search(r"EXIT=(\d+)", text or "")
        check(m is not None and m.group(1) == "130", "Ctrl-C at the prompt quits (exit 130)", m and m.group(0))
        if edit:
            lines = open(ih).read() if os.path.exists(ih) else ""
            check("Tell" in lines and "aXbc" in lines, "--input-history keeps the lines typed", lines[-200:])
    stop()

    # two Ctrl-C in a row mid-answer: quit
    if start(["-n", "-1", "--ignore-eos"], "chat (twice)"):
        tmux("send-keys", "-t", "t", "Tell me a long story.", "Enter")
        if wait_for(answer_begun("> Tell me a long story."), "the answer"):
            tmux("send-keys", "-t", "t", "C-c")
            tmux("send-keys", "-t", "t", "C-c")
        text = wait_for(lambda t: "EXIT=" in t, "the exit after two Ctrl-C")
        m = re.search(r"EXIT=(\d+)", text or "")
        check(m is not None and m.group(1) == "130", "two Ctrl-C in a row quit (exit 130)", m and m.group(0))
    stop()

    # -n beyond the context: said, and named by the turn line
    if start(["-n", "2000", "-c", "256", "--ignore-eos"], "chat -n 2000 -c 256"):
        tmux("send-keys", "-t", "t", "Hello.", "Enter")
        text = wait_for(lambda t: len(turns(t)) >= 1 and at_prompt(t), "the answer cut to fit")
        t = turns(text or "")
        check("-n 2000 leaves no room for a prompt in the context of 256 tokens: answers stop at 128" in (text or "")
              and len(t) == 1 and t[0][3] == 128 and "-n 2000 cut to fit the context of 256" in t[0][4],
              "-n 2000 -c 256: the cut is said at the start and in the turn line", (t, (text or "")[:300]))
        tmux("send-keys", "-t", "t", "C-d")
    stop()
finally:
    stop()
    subprocess.run(["rm", "-rf", tmp])
print("%d failed" % failures)
sys.exit(1 if failures else 0)
PY
