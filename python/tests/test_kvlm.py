"""kvlm's Python package against the kvlm command and itself: greedy text as
`kvlm run --temp 0`, streams equal to whole answers, OpenAI's fields, batched
generate equal to one prompt at a time, threads, create/close cycles without
growth, exception types, silence, the C structures' layout, the server."""
import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from conftest import KVLM_BIN, QUICK, ROOT

import kvlm

PROMPTS = ["Once upon a time", "One day", "The cat", "Lily and Tom", "There was a dog", "The sun was",
           "A little bird", "Mom said", "The boy ran", "She had a red", "In the park", "Tim liked",
           "The big tree", "They went to", "At night", "The girl saw"]


def kvlm_run(model, prompt, n):
    out = subprocess.run([KVLM_BIN, "run", "-m", model, "-p", prompt, "-n", str(n), "--temp", "0", "-t", "1"],
                         capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.decode().rstrip("\n")


# ---- the C structures as ctypes sees them, against the compiler ------------------
def test_struct_layout(tmp_path):
    from kvlm import _lib as L
    names = ["kvlm_error", "kvlm_model_params", "kvlm_ctx_params", "kvlm_batch", "kvlm_kv_stats",
             "kvlm_kv_tier_stats", "kvlm_sampler_params", "kvlm_sched_params", "kvlm_request_params",
             "kvlm_sched_event", "kvlm_embed_params", "kvlm_chat_params", "kvlm_detok", "kvlm_server_params"]
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include "kvlm.h"', "int main(void) {"]
    for n in names:
        lines.append(f'printf("{n} %zu\\n", sizeof({n}));')
        for f, _ in getattr(L, n)._fields_:
            lines.append(f'printf("{n}.{f} %zu\\n", offsetof({n}, {f}));')
    lines.append("return 0; }")
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines))
    cc = os.environ.get("CC", "cc")
    try:
        subprocess.run([cc, "-I", str(ROOT / "include"), "-o", str(tmp_path / "layout"), str(src)], check=True,
                       capture_output=True, timeout=60)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"no C compiler ({e})")
    got = dict(l.split() for l in subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True,
                                                    check=True).stdout.splitlines())
    for n in names:
        cls = getattr(L, n)
        assert int(got[n]) == __import__("ctypes").sizeof(cls), n
        for f, _ in cls._fields_:
            assert int(got[f"{n}.{f}"]) == getattr(cls, f).offset, f"{n}.{f}"


# ---- the same greedy text as kvlm run ----------------------------------------------
@pytest.mark.parametrize("which", ["m260k", "m4m"])
def test_greedy_as_kvlm_run(which, request):
    model = request.getfixturevalue(which)
    n = 24 if QUICK else 48
    with kvlm.Llama(model, n_threads=1) as llm:
        for prompt in PROMPTS[:2 if QUICK else 4]:
            out = llm(prompt, max_tokens=n, temperature=0)
            assert prompt + out["choices"][0]["text"] == kvlm_run(model, prompt, n)
            # echo puts the prompt first, as kvlm run prints it
            assert llm(prompt, max_tokens=n, temperature=0, echo=True)["choices"][0]["text"] == \
                kvlm_run(model, prompt, n)


def test_stream_equals_whole(m260k):
    with kvlm.Llama(m260k, n_threads=1) as llm:
        for prompt in PROMPTS[:3]:
            whole = llm(prompt, max_tokens=40, temperature=0)
            chunks = list(llm(prompt, max_tokens=40, temperature=0, stream=True))
            assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
            assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
            assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
            assert len({c["id"] for c in chunks}) == 1
            # a stop string: cut before it, streamed or not
            stop = whole["choices"][0]["text"][10:14]
            cut = llm(prompt, max_tokens=40, temperature=0, stop=[stop])
            assert cut["choices"][0]["text"] == whole["choices"][0]["text"][:10]
            assert cut["choices"][0]["finish_reason"] == "stop"
            s = "".join(c["choices"][0]["text"] for c in llm(prompt, max_tokens=40, temperature=0, stop=stop,
                                                                stream=True))
            assert s == cut["choices"][0]["text"]


def test_openai_fields(m260k):
    with kvlm.Llama(m260k, n_threads=1) as llm:
        r = llm("Once upon a time", max_tokens=8, temperature=0, logprobs=3)
        assert set(r) >= {"id", "object", "created", "model", "choices", "usage"}
        assert r["object"] == "text_completion" and r["id"].startswith("cmpl-")
        ch = r["choices"][0]
        assert set(ch) == {"text", "index", "logprobs", "finish_reason"}
        assert ch["finish_reason"] == "length"
        assert r["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}
        lp = ch["logprobs"]
        assert set(lp) == {"tokens", "text_offset", "token_logprobs", "top_logprobs"}
        assert len(lp["tokens"]) == 8 and "".join(lp["tokens"]) == ch["text"]
        assert all(len(t) == 3 for t in lp["top_logprobs"]) and all(x <= 0 for x in lp["token_logprobs"])
        # greedy: the chosen token is the likeliest
        assert all(abs(max(t.values()) - x) < 1e-5 for t, x in zip(lp["top_logprobs"], lp["token_logprobs"]))
        c = llm.create_chat_completion(messages=[{"role": "user", "content": "Hello"}], max_tokens=8,
                                       temperature=0)
        assert c["object"] == "chat.completion" and c["id"].startswith("chatcmpl-")
        assert set(c["choices"][0]) >= {"index", "message", "finish_reason", "logprobs"}
        assert c["choices"][0]["message"]["role"] == "assistant"
        assert isinstance(c["choices"][0]["message"]["content"], str)
        assert set(c["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
        chunks = list(llm.create_chat_completion(messages=[{"role": "user", "content": "Hello"}], max_tokens=8,
                                                 temperature=0, stream=True))
        assert all(k["object"] == "chat.completion.chunk" for k in chunks)
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
        assert "".join(k["choices"][0]["delta"].get("content") or "" for k in chunks) == \
            c["choices"][0]["message"]["content"]
        assert chunks[-1]["choices"][0]["finish_reason"] == c["choices"][0]["finish_reason"]
        # JSON mode holds the text to an object
        j = llm.create_chat_completion(messages=[{"role": "user", "content": "x"}], max_tokens=60, temperature=0,
                                       response_format={"type": "json_object"})
        if j["choices"][0]["finish_reason"] == "stop":
            assert isinstance(json.loads(j["choices"][0]["message"]["content"]), dict)


def test_tokens_and_embed(m260k):
    with kvlm.Llama(m260k, n_threads=1) as llm:
        toks = llm.tokenize(b"Once upon a time")
        assert toks[0] == llm.token_bos() and len(toks) == 5
        assert llm.detokenize(toks) == b"Once upon a time"
        assert llm.detokenize(llm.tokenize("héllo wörld", add_bos=False)) == "héllo wörld".encode()
        v = llm.embed("Once upon a time")
        assert len(v) == 64 and abs(sum(x * x for x in v) - 1) < 1e-4
        vs = llm.embed(["Once upon a time", "The cat"])
        assert vs[0] == pytest.approx(v, abs=1e-6) and vs[1] != vs[0]
        ref = subprocess.run([KVLM_BIN, "embed", "-m", llm.model_path, "-p", "Once upon a time", "-t", "1"],
                             capture_output=True, text=True, timeout=60)
        assert ref.returncode == 0, ref.stderr
        assert [float(x) for x in ref.stdout.split()] == pytest.approx(v, abs=1e-5)
        st = llm.kv_stats()
        assert st["n_blocks"] > 0 and st["block_size"] == 16 and "tiers" in st


def test_generate_batched_equals_alone(m260k):
    n = 8 if QUICK else 16
    sp = kvlm.SamplingParams(temperature=0, max_tokens=32)
    with kvlm.LLM(m260k, n_threads=1, max_num_seqs=16) as llm:
        outs = llm.generate(PROMPTS[:n], sp)
        assert [o.prompt for o in outs] == PROMPTS[:n]
        for p, o in zip(PROMPTS[:n], outs):
            alone = llm.generate([p], sp)[0]
            assert o.outputs[0].text == alone.outputs[0].text and o.outputs[0].token_ids == alone.outputs[0].token_ids
            assert o.prompt_token_ids == alone.prompt_token_ids
            assert o.outputs[0].finish_reason in ("stop", "length")
    # and equal to kvlm.Llama's greedy text
    with kvlm.Llama(m260k, n_threads=1) as one:
        assert one(PROMPTS[0], max_tokens=32, temperature=0)["choices"][0]["text"] == outs[0].outputs[0].text
    # n completions with seeds, logprobs
    with kvlm.LLM(m260k, n_threads=1) as llm:
        o = llm.generate("Once upon a time", kvlm.SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12,
                                                                 logprobs=2))[0]
        assert [c.index for c in o.outputs] == [0, 1, 2] and len({c.text for c in o.outputs}) > 1
        assert all(len(c.logprobs) == len(c.token_ids) for c in o.outputs)
        assert all(c.token_ids[i] in c.logprobs[i] for c in o.outputs for i in range(len(c.token_ids)))
        o2 = llm.generate("Once upon a time", kvlm.SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12))[0]
        assert [c.text for c in o2.outputs] == [c.text for c in o.outputs]
        assert len(llm.chat([{"role": "user", "content": "Hi"}], kvlm.SamplingParams(max_tokens=4))) == 1
        e = llm.embed(["Once upon a time", "The cat"])
        assert len(e) == 2 and len(e[0].outputs.embedding) == 64


def test_threads(m260k):
    n_threads = 4 if QUICK else 8
    prompts = PROMPTS[:n_threads]
    with kvlm.Llama(m260k, n_threads=1) as llm:
        want = [llm(p, max_tokens=40, temperature=0)["choices"][0]["text"] for p in prompts]
    got = [None] * n_threads
    errors = []

    def work(i):
        try:
            with kvlm.Llama(m260k, n_threads=1) as mine:
                for _ in range(2):
                    got[i] = mine(prompts[i], max_tokens=40, temperature=0)["choices"][0]["text"]
        except Exception as e:  # reported below
            errors.append(e)
    ts = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not errors and got == want
    # one object from several threads, and streams of one object interleaved
    with kvlm.Llama(m260k, n_threads=1) as llm:
        got = [None] * 4

        def shared(i):
            for _ in range(2):
                got[i] = llm(prompts[i], max_tokens=40, temperature=0)["choices"][0]["text"]
        ts = [threading.Thread(target=shared, args=(i,)) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        assert got == want[:4]
        a = llm(prompts[0], max_tokens=40, temperature=0, stream=True)
        b = llm.create_chat_completion([{"role": "user", "content": "Hi"}], max_tokens=40, temperature=0,
                                       stream=True)
        c = llm(prompts[1], max_tokens=40, temperature=0, stream=True)
        ta, tb, tc = [], [], []
        for x, y, z in zip(a, b, c):
            ta.append(x)
            tb.append(y)
            tc.append(z)
        ta += list(a)
        tb += list(b)
        tc += list(c)
        assert "".join(x["choices"][0]["text"] for x in ta) == want[0]
        assert "".join(x["choices"][0]["text"] for x in tc) == want[1]
        assert ta[-1]["choices"][0]["finish_reason"] and tc[-1]["choices"][0]["finish_reason"]
        whole = llm.create_chat_completion([{"role": "user", "content": "Hi"}], max_tokens=40, temperature=0)
        assert "".join(x["choices"][0]["delta"].get("content") or "" for x in tb) == \
            whole["choices"][0]["message"]["content"]
        assert llm.kv_stats()["used"] == 0


def rss_kib():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(os.environ.get("KVLM_PY_SANITIZER") == "1", reason="RSS under ASan's quarantine")
def test_create_close_cycles(m260k):
    cycles = 50 if QUICK else 1000  # the 1,000 (about 7 s)

    def cycle():
        llm = kvlm.Llama(m260k, n_threads=1)
        llm("Once", max_tokens=2, temperature=0)
        llm.close()
    for _ in range(20):
        cycle()
    before = rss_kib()
    for _ in range(cycles):
        cycle()
    # garbage collection frees too (no cycle keeps an object alive)
    for _ in range(cycles // 4):
        kvlm.Llama(m260k, n_threads=1)("Once", max_tokens=2, temperature=0)
    grown = rss_kib() - before
    assert grown < 4096, f"RSS grew {grown} KiB over {cycles} cycles"


def test_errors(m260k, tmp_path):
    with pytest.raises(kvlm.ModelNotFoundError) as e:
        kvlm.Llama(str(tmp_path / "nope.gguf"))
    assert isinstance(e.value, FileNotFoundError) and isinstance(e.value, kvlm.KvlmError) and "nope.gguf" in str(e.value)
    data = Path(m260k).read_bytes()
    trunc = tmp_path / "trunc.gguf"
    trunc.write_bytes(data[:len(data) // 2])
    with pytest.raises(kvlm.ModelFormatError) as e:
        kvlm.Llama(str(trunc))
    assert str(e.value)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + b"\xff" * 64)
    with pytest.raises(kvlm.ModelFormatError):
        kvlm.Llama(str(junk))
    with kvlm.Llama(m260k, n_threads=1) as llm:
        with pytest.raises(kvlm.InvalidArgumentError) as e:
            llm("x", temperature=5)
        assert isinstance(e.value, ValueError) and "temperature" in str(e.value)
        with pytest.raises(kvlm.InvalidArgumentError):
            llm("x", top_p=2)
        with pytest.raises(kvlm.InvalidArgumentError):
            llm("x", grammar="root ::= (")
        with pytest.raises(kvlm.InvalidArgumentError):
            llm("once " * 600, max_tokens=4)  # past the context
        assert llm("Once", max_tokens=4, temperature=0)["choices"][0]["text"]  # still usable
    with pytest.raises(kvlm.InvalidArgumentError):
        kvlm.Llama(m260k, cache_type_k="f7")
    # out of KV memory: a pool of 2 blocks (32 tokens)
    with kvlm.Llama(m260k, n_threads=1, kv_mem=2 * 16 * 4096) as small:
        blocks = small.kv_stats()["n_blocks"]
        with pytest.raises(kvlm.KvMemoryError):
            small.eval(list(range(1, 16 * blocks + 8)))
        small.reset()
        with pytest.raises(kvlm.InvalidArgumentError):  # a prompt the pool cannot hold (KVLM_ERANGE)
            small(list(range(1, 16 * blocks + 8)), max_tokens=2)
        # a completion that outgrows the pool ends as "length"
        assert small("Once", max_tokens=200, temperature=0)["choices"][0]["finish_reason"] in ("length", "stop")
    llm = kvlm.Llama(m260k, n_threads=1)
    llm.close()
    llm.close()
    with pytest.raises(kvlm.KvlmError):
        llm("x")


def test_silent_unless_verbose(m260k, capfd, tmp_path):
    with kvlm.Llama(m260k, n_threads=1) as llm:
        llm("Once upon a time", max_tokens=4, temperature=0)
        list(llm("Once", max_tokens=4, stream=True))
    with pytest.raises(kvlm.KvlmError):
        kvlm.Llama(str(tmp_path / "nope.gguf"))
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_interrupt_leaves_usable(m260k):
    with kvlm.Llama(m260k, n_threads=1) as llm:
        want = llm("Once upon a time", max_tokens=20, temperature=0)["choices"][0]["text"]
        # an abandoned stream
        it = llm("The cat", max_tokens=200, temperature=0, stream=True)
        next(it)
        next(it)
        it.close()
        # Ctrl-C in the middle of a generation
        timer = threading.Timer(0.05, lambda: signal.raise_signal(signal.SIGINT))
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            for _ in range(1000):
                llm("Lily", max_tokens=200, temperature=0)
        timer.join()
        assert llm("Once upon a time", max_tokens=20, temperature=0)["choices"][0]["text"] == want
        assert llm.kv_stats()["used"] == 0


@pytest.mark.parametrize("script", ["llama_cpp_style.py", "vllm_style.py"])
def test_examples(script, m260k):
    env = dict(os.environ, KVLM_EXAMPLE_MODEL=m260k, PYTHONPATH=str(ROOT / "python"))
    out = subprocess.run([sys.executable, str(ROOT / "python" / "examples" / script)], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    if script == "vllm_style.py":
        assert out.stdout.count("Generated text:") == 4
    else:
        assert "'object': 'text_completion'" in out.stdout and "chat.completion" in out.stdout


def test_server(m260k):
    p = subprocess.Popen([sys.executable, "-m", "kvlm.server", "--model", m260k, "--port", "0", "--quiet",
                          "--threads", "1"], stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT / "python")))
    try:
        line = p.stdout.readline()
        assert "listening on" in line, line
        url = line.split()[-1]
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}).encode()
        r = urllib.request.urlopen(urllib.request.Request(url + "/v1/completions", data=body,
                                                          headers={"Content-Type": "application/json"}), timeout=30)
        text = json.loads(r.read())["choices"][0]["text"]
        with kvlm.Llama(m260k, n_threads=1) as llm:
            assert text == llm("Once upon a time", max_tokens=16, temperature=0)["choices"][0]["text"]
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=20) == 0
        assert "stopped" in p.stdout.read()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_chat_tools_and_json(m260k):
    from conftest import MODELS
    tpl = MODELS.parent / "chat-templates" / "Qwen-Qwen2.5-7B-Instruct.jinja"
    if not tpl.exists():
        pytest.skip(f"{tpl} not found")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}]
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    with kvlm.Llama(m260k, n_ctx=2048, n_threads=1, chat_template=tpl.read_text()) as llm:
        r = llm.create_chat_completion(messages=msgs, tools=tools, tool_choice="required", max_tokens=80,
                                       temperature=0)
        ch = r["choices"][0]
        assert ch["finish_reason"] == "tool_calls" and ch["message"]["content"] is None
        call = ch["message"]["tool_calls"][0]
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] == "get_weather"
        args = json.loads(call["function"]["arguments"])
        assert isinstance(args["city"], str) and len(args["city"]) <= 8
        chunks = list(llm.create_chat_completion(messages=msgs, tools=tools, tool_choice="required",
                                                 max_tokens=80, temperature=0, stream=True))
        deltas = [c["choices"][0]["delta"] for c in chunks]
        streamed = "".join(tc["function"].get("arguments", "") for d in deltas for tc in d.get("tool_calls", []))
        assert streamed == call["function"]["arguments"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        with pytest.raises(kvlm.InvalidArgumentError):
            llm.create_chat_completion(messages=msgs, tools=[{"type": "function"}], max_tokens=4)
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
        j = llm.create_chat_completion(messages=[{"role": "user", "content": "x"}], max_tokens=60, temperature=0,
                                       response_format={"type": "json_object", "schema": schema})
        assert j["choices"][0]["finish_reason"] == "stop"
        assert isinstance(json.loads(j["choices"][0]["message"]["content"])["a"], int)


def test_eval_logits(m260k):
    np = pytest.importorskip("numpy")
    with kvlm.Llama(m260k, n_threads=1) as llm:
        want = llm("Once upon a time", max_tokens=12, temperature=0)
        toks = llm.tokenize(b"Once upon a time")
        llm.eval(toks)
        out = []
        for _ in range(12):
            logits = llm.logits()
            assert logits.dtype == np.float32 and logits.shape == (llm.n_vocab(),) and not logits.flags.owndata
            out.append(int(np.argmax(logits)))
            llm.eval([out[-1]])
        assert llm.n_tokens == len(toks) + 12
        assert out == llm.tokenize(want["choices"][0]["text"].encode(), add_bos=False) or \
            llm.detokenize(out, prev_tokens=toks).decode() == want["choices"][0]["text"]
        # a completion after eval starts afresh, the same text
        assert llm("Once upon a time", max_tokens=12, temperature=0)["choices"][0]["text"] == want["choices"][0]["text"]
        assert llm.n_tokens == 0 and llm.kv_stats()["used"] == 0
        with pytest.raises(kvlm.InvalidArgumentError):
            llm.logits()
        llm.eval(toks)
        llm.reset()
        assert llm.n_tokens == 0 and llm.kv_stats()["used"] == 0


def test_save_load_state(m260k):
    np = pytest.importorskip("numpy")
    llm_prompt = b"Once upon a time there was a little girl named Lily. She loved to play outside"
    with kvlm.Llama(m260k, n_threads=1) as a, kvlm.Llama(m260k, n_threads=1) as b:
        toks = a.tokenize(llm_prompt)
        assert len(toks) > 16  # at least one full block saved
        a.eval(toks)
        want = np.array(a.logits())
        st = a.save_state()
        assert st.n_tokens == len(toks) and len(st.data) > 0
        a.reset()
        for obj in (a, b):
            obj.load_state(st)
            assert obj.n_tokens == len(toks)
            assert np.allclose(obj.logits(), want, atol=1e-5)
        # b computed only the tokens after the saved full blocks
        assert b.kv_stats()["tokens_computed"] <= len(toks) - 16


def test_verbose_log(m260k, capfd):
    from ctypes import c_char_p, c_int
    from kvlm import _lib as L
    lib = L.lib()

    def say(text):
        lib.kvlm_log(c_int(L.LOG_ERROR), c_char_p(b"%s"), c_char_p(text.encode()))
    with kvlm.Llama(m260k, n_threads=1, verbose=True):
        say("while verbose")
    say("after close")
    out, err = capfd.readouterr()
    assert out == "" and err == "kvlm error: while verbose\n"


def test_streams_dropped(m260k):
    import gc
    with kvlm.Llama(m260k, n_threads=1) as llm:
        want = llm("Once upon a time", max_tokens=20, temperature=0)["choices"][0]["text"]
        llm("The cat", max_tokens=200, stream=True)  # never iterated: nothing submitted
        for _ in range(5):
            it = llm("The cat", max_tokens=200, temperature=0, stream=True)
            next(it)
            del it  # dropped mid-stream: the collector closes it, its request cancelled
        gc.collect()
        assert llm("Once upon a time", max_tokens=20, temperature=0)["choices"][0]["text"] == want
        st = llm.kv_stats()
        assert st["used"] == 0
    from kvlm import _engine
    assert not _engine._REQS


def test_pip_install(tmp_path):
    import shutil
    if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode != 0:
        pytest.skip("no pip for this interpreter (python3-pip)")
    src = tmp_path / "src"
    shutil.copytree(ROOT / "python", src, ignore=shutil.ignore_patterns("tests", "__pycache__", "build", "*.egg-info"))
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-index",
                        "--disable-pip-version-check", "--target", str(target), str(src)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (target / "kvlm" / "py.typed").exists()
    env = dict(os.environ, PYTHONPATH=str(target))
    r = subprocess.run([sys.executable, "-c", "import kvlm; print(kvlm.__file__); print(kvlm.version())"],
                       capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].startswith(str(target)) and r.stdout.splitlines()[1].startswith("0.")


def test_prompt_logprobs(m260k):
    np = pytest.importorskip("numpy")
    with kvlm.LLM(m260k, n_threads=1) as llm:
        o = llm.generate("Once upon a time there was",
                         kvlm.SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2))[0]
    t = o.prompt_token_ids
    assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(t)
    # against a log-softmax, in float64, of the logits eval() gives after each prefix
    with kvlm.Llama(m260k, n_threads=1) as one:
        for pos in range(1, len(t)):
            one.reset()
            one.eval(t[:pos])
            x = one.logits().astype(np.float64)
            ls = x - x.max() - np.log(np.exp(x - x.max()).sum())
            d = o.prompt_logprobs[pos]
            assert t[pos] in d and 2 <= len(d) <= 3
            for tok, lp in d.items():
                assert abs(ls[tok] - lp) < 1e-4
