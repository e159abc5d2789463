#!/usr/bin/env python3
"""tests/helpers/layers.py SRC_DIR: the layer rules of docs/architecture.md (and ../shared/DESIGN.md),
checked on every #include of src/ ("layer/x.h", or <layer/x.h>, which finds the same file): each
layer includes only its own headers, those of the
layers above it (util, dtype, model, tok, ops, kv, engine, server, cli: in that order) and include/kvlm.h;
the server and the command go through include/kvlm.h (besides their own headers, only util/'s);
every folder of src/ is one of the layers; JSON (jansson) is read and written only where requests,
templates and file formats are (model, tok, server, cli), never in util, dtype, ops, kv or the engine. Prints each violation (file:line, the rule) and exits 1
if there is one. --self-test plants one violation of each rule in a copy and checks that each is
found (so the check can fail)."""
import os, re, shutil, sys, tempfile

LAYERS = ["util", "dtype", "model", "tok", "ops", "kv", "engine", "server", "cli"]
THROUGH_API = {"server", "cli"}  # only kvlm.h, their own headers and util/
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
SYSTEM = re.compile(r'^\s*#\s*include\s+<([^>]+)>')
JSON_LAYERS = {"model", "tok", "server", "cli"}  # the others take what a request or file said already read
# <layer/x.h> finds the same file (src/ is on the include path): checked as "layer/x.h" is
ANGLED = re.compile(r'^\s*#\s*include\s+<((%s)/[^>]+)>' % "|".join(LAYERS))


def violations(src):
    out = []
    for top in sorted(os.listdir(src)):
        path = os.path.join(src, top)
        if not os.path.isdir(path):
            continue
        if top not in LAYERS:
            out.append("%s/: a folder that is no layer (add it to the layers' list and the map)" % top)
            continue
        me = LAYERS.index(top)
        for root, _, files in os.walk(path):
            for f in sorted(files):
                if not f.endswith((".c", ".h", ".cu")):
                    continue
                fp = os.path.join(root, f)
                rel = os.path.relpath(fp, src)
                with open(fp, encoding="utf-8", errors="replace") as fh:
                    for no, line in enumerate(fh, 1):
                        sm = SYSTEM.match(line)
                        if sm and sm.group(1) == "jansson.h" and top not in JSON_LAYERS:
                            out.append("src/%s:%d: #include <jansson.h>: %s/ does not parse JSON (model, tok, server "
                                       "and cli do)" % (rel, no, top))
                        m = INCLUDE.match(line) or ANGLED.match(line)
                        if not m:
                            continue
                        inc = m.group(1)
                        where = "src/%s:%d: %s" % (rel, no, line.strip())
                        if inc == "kvlm.h":
                            continue
                        if "/" not in inc:  # beside the file, or generated into the build (the web page)
                            if not os.path.exists(os.path.join(root, inc)) and not inc.startswith("web_"):
                                out.append("%s: neither beside it nor a layer's header" % where)
                            continue
                        layer = inc.split("/", 1)[0]
                        if layer not in LAYERS:
                            out.append("%s: not a layer's header" % where)
                        elif LAYERS.index(layer) > me:
                            out.append("%s: %s/ is below %s/ (a layer includes only those above it)" % (where, layer, top))
                        elif top in THROUGH_API and layer not in (top, "util"):
                            out.append("%s: %s/ goes through include/kvlm.h, not %s/'s internal headers" % (where, top, layer))
    return out


def self_test(src):
    plants = [("kv/pool.c", '#include "engine/engine.h"', "below kv/"),
              ("model/gguf.c", '#include "tok/tok.h"', "below model/"),
              ("server/server.c", '#include "kv/store.h"', "goes through include/kvlm.h"),
              ("cli/main.c", '#include "model/model.h"', "goes through include/kvlm.h"),
              ("server/openai.c", '#include <engine/engine.h>', "goes through include/kvlm.h"),
              ("tok/bpe.c", '#include "nowhere.h"', "neither beside it"),
              ("newlayer/x.c", "", "no layer"),
              ("engine/sched.c", "#include <jansson.h>", "does not parse JSON"),
              ("dtype/tq.c", '#include "model/model.h"', "below dtype/")]
    bad = 0
    for target, line, want in plants:
        tmp = tempfile.mkdtemp()
        try:
            copy = os.path.join(tmp, "src")
            shutil.copytree(src, copy)
            fp = os.path.join(copy, target)
            os.makedirs(os.path.dirname(fp), exist_ok=True)
            old = open(fp).read() if os.path.exists(fp) else ""
            with open(fp, "w") as fh:
                fh.write(line + "\n" + old)
            found = [v for v in violations(copy) if want in v]
            print("%s  a planted violation in src/%s (%s) is found: %s" % ("ok  " if found else "FAIL", target,
                  line or "a new folder", found[0] if found else "nothing"))
            bad += not found
        finally:
            shutil.rmtree(tmp)
    return bad


if __name__ == "__main__":
    src = sys.argv[1]
    if "--self-test" in sys.argv:
        sys.exit(1 if self_test(src) else 0)
    v = violations(src)
    for x in v:
        print("FAIL " + x)
    print("%d violations of the layer rules in src/" % len(v))
    sys.exit(1 if v else 0)
