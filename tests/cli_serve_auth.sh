#!/usr/bin/env bash
# tests/cli_serve_auth: `kvlm serve` cannot be driven from someone else's web page
# (loopback only, python3 stdlib + curl + openssl or certtool): the API key from
# --api-key, KVLM_API_KEY and --api-key-file (401 with an OpenAI-style error without
# it or with a wrong one, 200 with it; /health, the page and, unless --metrics-auth,
# /metrics open), CORS only for --cors-origin origins (allowed and denied origins,
# preflights: 204 or 403, on whole and streamed answers), 415 for POST bodies that
# are not application/json, and a TLS round trip with a self-signed certificate made
# here (curl --cacert); TLS 1.2 and 1.3 accepted, 1.0 and 1.1 refused (openssl s_client),
# and only 1.3 with --ssl-min-version tls1.3. The constant-time comparison is for code
# review (key_ok in src/server/server.c).
set -uo pipefail
KVLM="${KVLM_BIN:?KVLM_BIN must point at the kvlm binary}"
MODELS="${KVLM_MODELS:-${KVLM_MODELS_DEFAULT:-../shared/models}}"
MODEL="$MODELS/stories260K.gguf"
skip() { echo "SKIP: $*"; exit 77; }
[ -f "$MODEL" ] || skip "$MODEL not found (set KVLM_MODELS)"
command -v curl >/dev/null || skip "curl not found (bash scripts/setup.sh installs it)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# a self-signed certificate for 127.0.0.1, made here
if command -v openssl >/dev/null; then
  openssl req -x509 -newkey rsa:2048 -nodes -keyout "$tmp/key.pem" -out "$tmp/cert.pem" -days 2 \
    -subj "/CN=127.0.0.1" -addext "subjectAltName=IP:127.0.0.1,DNS:localhost" >/dev/null 2>&1
elif command -v certtool >/dev/null; then
  certtool --generate-privkey --outfile "$tmp/key.pem" >/dev/null 2>&1
  printf 'cn = 127.0.0.1\nip_address = 127.0.0.1\ndns_name = localhost\nexpiration_days = 2\nca\ntls_www_server\n' \
    >"$tmp/cert.cfg"
  certtool --generate-self-signed --load-privkey "$tmp/key.pem" --template "$tmp/cert.cfg" \
    --outfile "$tmp/cert.pem" >/dev/null 2>&1
else
  skip "neither openssl nor certtool found (bash scripts/setup.sh installs gnutls-bin)"
fi
[ -s "$tmp/cert.pem" ] || { echo "FAIL: could not make a self-signed certificate"; exit 1; }
timeout -k 5 180 python3 - "$KVLM" "$MODEL" "$tmp" <<'PY'
import http.client, json, os, re, subprocess, sys, time

kvlm, model, tmp = sys.argv[1:4]
KEY = "sk-kvlm-test-0123456789abcdef"
failures = 0
procs = []

def check(cond, name, detail=""):
    global failures
    print(("ok   " if cond else "FAIL ") + name + ("" if cond else " " + str(detail)[:400]), flush=True)
    failures += 0 if cond else 1

def start(args, env=None, scheme="http"):
    e = dict(os.environ); e.pop("KVLM_API_KEY", None); e.update(env or {})
    p = subprocess.Popen([kvlm, "serve", "-m", model, "--port", "0", "-t", "1"] + args,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e)
    procs.append(p)
    line = p.stdout.readline()
    m = re.fullmatch(r"kvlm serve: listening on %s://127\.0\.0\.1:(\d+)\n" % scheme, line)
    if not m:
        print("FAIL: no listening line, got %r; stderr: %s" % (line, p.stderr.read()))
        sys.exit(1)
    return p, int(m.group(1))

def stop(p):
    p.terminate()
    try:
        rc = p.wait(10)
    except subprocess.TimeoutExpired:
        p.kill(); rc = -9
    check(rc == 0, "server stopped cleanly", rc)

def req(port, method, path, body=None, headers=None, ctype="application/json"):
    """(status, headers dict lower-cased, parsed JSON or text)"""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    h = dict(headers or {})
    data = None
    if body is not None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        if ctype is not None: h["Content-Type"] = ctype
    c.request(method, path, body=data, headers=h)
    r = c.getresponse()
    text = r.read().decode("utf-8", "replace")
    hd = {k.lower(): v for k, v in r.getheaders()}
    c.close()
    try:
        return r.status, hd, json.loads(text)
    except ValueError:
        return r.status, hd, text

def is_err(j, code, type_="invalid_request_error"):
    return isinstance(j, dict) and isinstance(j.get("error"), dict) and j["error"].get("code") == code \
        and j["error"].get("type") == type_ and isinstance(j["error"].get("message"), str)

CMPL = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
AUTH = {"Authorization": "Bearer " + KEY}

# ---- the API key, from --api-key
p, port = start(["--api-key", KEY])
for method, path, body in [("GET", "/v1/models", None), ("GET", "/kvlm/status", None),
                           ("POST", "/v1/completions", CMPL), ("POST", "/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})]:
    st, _, j = req(port, method, path, body)
    check(st == 401 and is_err(j, "invalid_api_key"), "%s %s without a key -> 401 invalid_api_key" % (method, path),
          (st, j))
    st, _, j = req(port, method, path, body, AUTH)
    check(st == 200, "%s %s with the key -> 200" % (method, path), (st, j))
for name, h in [("wrong key", "Bearer sk-kvlm-test-0123456789abcdeX"), ("key prefix", "Bearer " + KEY[:-1]),
                ("key plus a byte", "Bearer " + KEY + "0"), ("other scheme", "Basic " + KEY),
                ("empty bearer", "Bearer "), ("bare key", KEY)]:
    st, _, j = req(port, "GET", "/v1/models", headers={"Authorization": h})
    check(st == 401 and is_err(j, "invalid_api_key"), "%s -> 401" % name, (st, j))
st, _, j = req(port, "GET", "/v1/models", headers={"Authorization": "bearer " + KEY})
check(st == 200, "scheme is case-insensitive (bearer)", st)
for path in ["/health", "/metrics", "/"]:
    st, _, _ = req(port, "GET", path)
    check(st == 200, "GET %s open without a key" % path, st)
# a streamed completion with the key
st, _, text = req(port, "POST", "/v1/completions", dict(CMPL, stream=True), AUTH)
check(st == 200 and "data: [DONE]" in text, "streamed completion with the key", (st, text[:200]))
# no CORS by default: no Access-Control-Allow-Origin, preflights refused
st, hd, _ = req(port, "GET", "/health", headers={"Origin": "http://evil.example"})
check(st == 200 and "access-control-allow-origin" not in hd, "no Access-Control-Allow-Origin by default", hd)
st, hd, _ = req(port, "POST", "/v1/completions", CMPL, dict(AUTH, Origin="http://evil.example"))
check(st == 200 and "access-control-allow-origin" not in hd, "... nor on a completion", hd)
st, hd, j = req(port, "OPTIONS", "/v1/completions", headers={"Origin": "http://evil.example",
                "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"})
check(st == 403 and "access-control-allow-origin" not in hd and is_err(j, "cors_origin_not_allowed"),
      "preflight with no origin allowed -> 403", (st, hd, j))
# POST bodies must be application/json
for name, ct in [("text/plain", "text/plain"), ("form", "application/x-www-form-urlencoded"),
                 ("no Content-Type", None), ("application/jsonx", "application/jsonx")]:
    st, _, j = req(port, "POST", "/v1/completions", CMPL, AUTH, ctype=ct)
    check(st == 415 and is_err(j, "unsupported_media_type"), "POST with %s -> 415" % name, (st, j))
for ct in ["application/json; charset=utf-8", "Application/JSON"]:
    st, _, j = req(port, "POST", "/v1/completions", CMPL, AUTH, ctype=ct)
    check(st == 200, "POST with %s -> 200" % ct, (st, j))
st, _, j = req(port, "POST", "/v1/completions", CMPL, ctype="text/plain")
check(st == 401, "the key is checked before the body's type", st)
stop(p)

# ---- --metrics-auth; the key from KVLM_API_KEY
p, port = start(["--metrics-auth"], env={"KVLM_API_KEY": KEY})
st, _, j = req(port, "GET", "/metrics")
check(st == 401 and is_err(j, "invalid_api_key"), "--metrics-auth: /metrics without a key -> 401", st)
st, _, text = req(port, "GET", "/metrics", headers=AUTH)
check(st == 200 and "kvlm_requests_total" in text, "--metrics-auth: /metrics with the key -> 200", st)
st, _, _ = req(port, "GET", "/v1/models")
check(st == 401, "KVLM_API_KEY: without a key -> 401", st)
st, _, _ = req(port, "GET", "/v1/models", headers=AUTH)
check(st == 200, "KVLM_API_KEY: with the key -> 200", st)
st, _, _ = req(port, "GET", "/health")
check(st == 200, "/health still open", st)
stop(p)

# ---- --api-key-file (first line, its end stripped); the page asks for the key
kf = os.path.join(tmp, "key.txt")
open(kf, "w").write(KEY + "\n")
p, port = start(["--api-key-file", kf])
st, _, _ = req(port, "GET", "/v1/models")
check(st == 401, "--api-key-file: without a key -> 401", st)
st, _, _ = req(port, "GET", "/v1/models", headers=AUTH)
check(st == 200, "--api-key-file: with the key -> 200", st)
st, _, page = req(port, "GET", "/")
check(st == 200 and "Authorization" in page and "api-key" in page, "the web page can send a key", st)
stop(p)

# ---- CORS for the named origins only
A, B = "http://app.example", "https://other.example:8443"
p, port = start(["--cors-origin", A, "--cors-origin", B])
for o in (A, B):
    st, hd, _ = req(port, "GET", "/v1/models", headers={"Origin": o})
    check(st == 200 and hd.get("access-control-allow-origin") == o and "Origin" in hd.get("vary", ""),
          "allowed origin %s gets Access-Control-Allow-Origin" % o, hd)
    st, hd, text = req(port, "OPTIONS", "/v1/chat/completions", headers={"Origin": o,
                       "Access-Control-Request-Method": "POST",
                       "Access-Control-Request-Headers": "authorization, content-type"})
    methods = hd.get("access-control-allow-methods", "")
    allowed = hd.get("access-control-allow-headers", "").lower()
    check(st == 204 and hd.get("access-control-allow-origin") == o and "POST" in methods
          and "authorization" in allowed and "content-type" in allowed, "preflight from %s -> 204" % o, (st, hd))
for o in ["http://evil.example", A + ".evil.example", "null", A.upper()]:
    st, hd, _ = req(port, "GET", "/v1/models", headers={"Origin": o})
    check(st == 200 and "access-control-allow-origin" not in hd, "origin %s gets no Allow-Origin" % o, hd)
    st, hd, j = req(port, "OPTIONS", "/v1/completions", headers={"Origin": o, "Access-Control-Request-Method": "POST"})
    check(st == 403 and "access-control-allow-origin" not in hd, "preflight from %s -> 403" % o, (st, hd))
st, hd, text = req(port, "POST", "/v1/completions", dict(CMPL, stream=True), {"Origin": A})
check(st == 200 and hd.get("access-control-allow-origin") == A and "[DONE]" in text,
      "streamed answer to an allowed origin carries Allow-Origin", hd)
st, hd, _ = req(port, "POST", "/v1/completions", CMPL, {"Origin": A})
check(st == 200 and hd.get("access-control-allow-origin") == A, "whole answer to an allowed origin too", hd)
stop(p)

# ---- bad settings are refused at start
for args, what in [(["--ssl-key-file", os.path.join(tmp, "key.pem")], "a TLS key without a certificate"),
                   (["--ssl-key-file", os.path.join(tmp, "nope.pem"), "--ssl-cert-file", os.path.join(tmp, "cert.pem")],
                    "a missing TLS key file"),
                   (["--ssl-key-file", os.path.join(tmp, "cert.pem"), "--ssl-cert-file", os.path.join(tmp, "cert.pem")],
                    "a certificate given as the key"),
                   (["--api-key", ""], "an empty API key"), (["--cors-origin", "*"], "--cors-origin *")]:
    r = subprocess.run([kvlm, "serve", "-m", model, "--port", "0"] + args, capture_output=True, text=True, timeout=30)
    check(r.returncode == 1 and "kvlm serve:" in r.stderr and "listening" not in r.stdout,
          "refused: %s (%s)" % (what, r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""), (r.returncode, r.stderr))

# ---- TLS round trip with the self-signed certificate (curl --cacert)
p, port = start(["--ssl-key-file", os.path.join(tmp, "key.pem"), "--ssl-cert-file", os.path.join(tmp, "cert.pem"),
                 "--api-key", KEY], scheme="https")
url = "https://127.0.0.1:%d" % port
cacert = os.path.join(tmp, "cert.pem")
def curl(*args):
    r = subprocess.run(["curl", "-sS", "--max-time", "30", "--cacert", cacert, "-w", "\n%{http_code}"] + list(args),
                       capture_output=True, text=True)
    body, _, code = r.stdout.rpartition("\n")
    return r.returncode, code, body, r.stderr
rc, code, body, err = curl(url + "/health")
check(rc == 0 and code == "200" and json.loads(body) == {"status": "ok"}, "TLS: GET /health -> 200", (rc, code, err))
rc, code, body, err = curl("-H", "Authorization: Bearer " + KEY, "-H", "Content-Type: application/json",
                           "-d", json.dumps(CMPL), url + "/v1/completions")
ok = rc == 0 and code == "200"
check(ok and json.loads(body)["choices"][0]["text"], "TLS: completion with the key -> 200", (rc, code, body, err))
rc, code, body, err = curl("-H", "Content-Type: application/json", "-d", json.dumps(CMPL), url + "/v1/completions")
check(rc == 0 and code == "401", "TLS: completion without the key -> 401", (rc, code))
rc, code, body, err = curl("-H", "Authorization: Bearer " + KEY, "-H", "Content-Type: application/json",
                           "-d", json.dumps(dict(CMPL, stream=True)), url + "/v1/completions")
check(rc == 0 and code == "200" and "data: [DONE]" in body, "TLS: streamed completion", (rc, code))
r = subprocess.run(["curl", "-sS", "--max-time", "10", url + "/health"], capture_output=True, text=True)
check(r.returncode != 0, "TLS: a client that does not trust the certificate is refused", r.returncode)
r = subprocess.run(["curl", "-sS", "--max-time", "5", "http://127.0.0.1:%d/health" % port], capture_output=True,
                   text=True)
check(r.returncode != 0 or '"ok"' not in r.stdout, "TLS: plain HTTP on the TLS port gets no answer", r.returncode)
rc, code, body, err = curl(url + "/health")
check(rc == 0 and code == "200", "TLS: still serving after those", (rc, code))

# ---- TLS versions (openssl s_client): 1.2 and 1.3, never 1.0 or 1.1. SECLEVEL=0 lets Debian's OpenSSL
# offer the old versions and their ciphers, so a refusal seen here is the server's.
def handshake(port, flag):
    r = subprocess.run(["openssl", "s_client", "-connect", "127.0.0.1:%d" % port, flag, "-cipher", "DEFAULT:@SECLEVEL=0"],
                       input="", capture_output=True, text=True, timeout=30)
    new = re.search(r"^New, (\S+), Cipher is (\S+)", r.stdout, re.M)
    if not new or new.group(2) == "(NONE)":
        return None
    # the version negotiated (the "New," line names the cipher's; TLS 1.3 prints no session block)
    m = re.search(r"^\s*Protocol\s*:\s*(\S+)", r.stdout, re.M)
    return m.group(1) if m else new.group(1)
has_openssl = subprocess.run(["sh", "-c", "command -v openssl"], capture_output=True).returncode == 0
if has_openssl:
    got = {f: handshake(port, f) for f in ("-tls1", "-tls1_1", "-tls1_2", "-tls1_3")}
    check(got["-tls1"] is None and got["-tls1_1"] is None, "TLS 1.0 and 1.1 are refused by default", got)
    check(got["-tls1_2"] == "TLSv1.2" and got["-tls1_3"] == "TLSv1.3", "TLS 1.2 and 1.3 are accepted", got)
else:
    print("skip TLS versions: no openssl client")
stop(p)
if has_openssl:
    p, port = start(["--ssl-key-file", os.path.join(tmp, "key.pem"), "--ssl-cert-file", os.path.join(tmp, "cert.pem"),
                     "--ssl-min-version", "tls1.3"], scheme="https")
    got = {f: handshake(port, f) for f in ("-tls1_1", "-tls1_2", "-tls1_3")}
    check(got["-tls1_1"] is None and got["-tls1_2"] is None and got["-tls1_3"] == "TLSv1.3",
          "--ssl-min-version tls1.3: TLS 1.2 refused too, 1.3 accepted", got)
    stop(p)
for args, what in [(["--ssl-key-file", os.path.join(tmp, "key.pem"), "--ssl-cert-file", os.path.join(tmp, "cert.pem"),
                     "--ssl-min-version", "tls1.1"], "--ssl-min-version tls1.1"),
                   (["--ssl-min-version", "tls1.2"], "--ssl-min-version without TLS")]:
    r = subprocess.run([kvlm, "serve", "-m", model, "--port", "0"] + args, capture_output=True, text=True, timeout=30)
    check(r.returncode == 1 and "--ssl-min-version" in r.stderr and "listening" not in r.stdout,
          "refused: %s (%s)" % (what, r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""), (r.returncode, r.stderr))
for q in procs:
    if q.poll() is None: q.kill()
print("PASS" if not failures else "%d FAILURES" % failures)
sys.exit(1 if failures else 0)
PY
