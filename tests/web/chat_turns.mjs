// tests/web/chat_turns.mjs: a many-turn chat through `kvlm serve` with the official `openai`
// npm client, every turn streamed and its answer sent back as the client got it: from turn 2
// on at least 95% of each prompt (every full block of the previous turn) comes from the
// prefix cache, and the answers equal cold runs (fresh servers) on the same prompt ids.
// Run by tests/cli_serve_turns_openai.sh: KVLM_BIN, KVLM_MODEL, LABEL, TURNS, MAX_TOKENS,
// RULES, MIN_SHARE, KV_MEM, NEAR_TIE, BAN (token ids, space-separated), COLD ("all" or "ends").
import OpenAI from 'openai';
import { spawn } from 'node:child_process';
import path from 'node:path';

const env = process.env;
const KVLM = env.KVLM_BIN, MODEL = env.KVLM_MODEL, LABEL = env.LABEL || path.basename(MODEL);
const TURNS = +(env.TURNS || 8), MAX_TOKENS = +(env.MAX_TOKENS || 48), RULES = +(env.RULES || 60);
const NEAR_TIE = +(env.NEAR_TIE || 0), COLD = env.COLD || 'all', MIN_SHARE = +(env.MIN_SHARE ?? 0.95);
const BAN = (env.BAN || '').split(/\s+/).filter(Boolean);
const MODEL_ID = path.basename(MODEL).replace(/\.[^.]*$/, '');
const SERVE = ['--chat-template', 'chatml', '-c', '4096', '-t', '2', '--max-seqs', '4', '--kv-mem', env.KV_MEM || '256MiB'];

let pass = 0, fail = 0;
function check(cond, name, detail) {
  if (cond) { pass++; console.log(`ok   ${LABEL}: ${name}`); }
  else { fail++; console.log(`FAIL ${LABEL}: ${name} ${detail === undefined ? '' : JSON.stringify(detail).slice(0, 600)}`); }
  return cond;
}

// servers not stopped yet: killed when this script ends, however it ends
const live = new Set();
process.on('exit', () => { for (const p of live) p.kill('SIGKILL'); });
process.on('SIGTERM', () => process.exit(1));

// `kvlm serve --port 0 ...` until stop(): its URL once it listens.
async function serve(extra = []) {
  const p = spawn(KVLM, ['serve', '-m', MODEL, '--port', '0', ...SERVE, ...extra], { stdio: ['ignore', 'pipe', 'pipe'] });
  live.add(p);
  let out = '', err = '';
  p.stderr.on('data', (d) => { err += d; });
  const url = await new Promise((resolve, reject) => {
    p.stdout.on('data', (d) => {
      out += d;
      const m = out.match(/kvlm serve: listening on (\S+)\n/);
      if (m) resolve(m[1]);
    });
    p.on('exit', (code) => reject(new Error(`kvlm serve exited (${code}) before listening: ${err}`)));
  });
  const exited = new Promise((resolve) => p.on('exit', (code, sig) => resolve(code ?? sig)));
  return {
    url,
    client: new OpenAI({ baseURL: url + '/v1', apiKey: 'x', maxRetries: 0, timeout: 120000 }),
    async post(what, body) {
      const r = await fetch(url + what, { method: 'POST', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify(body) });
      return r.json();
    },
    async metric(name) {
      const text = await (await fetch(url + '/metrics')).text();
      const m = text.match(new RegExp(`^${name} (\\S+)$`, 'm'));
      return m ? +m[1] : null;
    },
    async stop() {
      p.kill('SIGTERM');
      const code = await exited;
      live.delete(p);
      check(code === 0 && !/Sanitizer|runtime error/.test(err), 'the server stopped cleanly', `${code}: ${err.slice(-2000)}`);
    },
  };
}

const sampling = (body) => ({ ...body, model: MODEL_ID, max_tokens: MAX_TOKENS, temperature: 0,
  ...(BAN.length ? { logit_bias: Object.fromEntries(BAN.map((id) => [id, -100])) } : {}) });

// As tests/helpers/chat_turns.py: a long system message, short user messages.
const WORDS = ('the little cat saw a big red ball in the garden and ran to get it while her friend the dog ' +
  'watched from under the old tree near the house where they lived with a kind girl named Lily').split(' ');
const SYSTEM = 'You tell short stories to children. ' + Array.from({ length: RULES }, (_, i) =>
  `${Array.from({ length: 9 }, (_, k) => WORDS[(i * 7 + k) % WORDS.length]).join(' ')} Story rule ${i}.`).join(' ');
const USERS = ['Tell me a story.', 'What next?', 'Who came?', 'Why?', 'Where to?', 'And then?', 'How did it end?', 'One more.'];
const whole = (t) => Math.floor((t.prompt + t.completion - 1) / 16) * 16; // full blocks of 16 tokens

// Where the cold run's tokens leave the warm answer; near: the warm answer's next token was
// among the cold run's top tokens within NEAR_TIE nats of its choice (tests/helpers/chat_turns.py).
function parting(lp, warm) {
  let p = 0, prevEmpty = false;
  const strip = (t) => (prevEmpty && t.startsWith(' ') ? t.slice(1) : t); // no space after BOS
  for (let i = 0; i < lp.tokens.length; i++) {
    const t = strip(lp.tokens[i]);
    if (!warm.startsWith(t, p)) {
      const chosen = lp.token_logprobs[i];
      const near = Object.entries(lp.top_logprobs[i]).some(([a, v]) => a !== lp.tokens[i] && a && v >= chosen - NEAR_TIE &&
        warm.startsWith(strip(a), p));
      return { at: i, near };
    }
    p += t.length;
    prevEmpty = lp.tokens[i] === '';
  }
  return p === warm.length ? null : { at: lp.tokens.length, near: false };
}

const srv = await serve();
const msgs = [{ role: 'system', content: SYSTEM }], turns = [];
for (let t = 0; t < TURNS; t++) {
  msgs.push({ role: 'user', content: USERS[t % USERS.length] });
  const ids = (await srv.post('/tokenize', { messages: msgs })).tokens;
  const stream = await srv.client.chat.completions.create(sampling({ messages: msgs, stream: true,
    stream_options: { include_usage: true } }));
  let answer = '', usage = null;
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) answer += c.delta?.content ?? '';
  }
  turns.push({ ids, answer, prompt: usage.prompt_tokens, cached: usage.prompt_tokens_details?.cached_tokens ?? 0,
    completion: usage.completion_tokens });
  msgs.push({ role: 'assistant', content: answer });
  const r = turns[t];
  console.log(`  ${LABEL} turn ${t + 1}: ${r.prompt} prompt tokens, ${r.cached} cached (${(100 * r.cached / r.prompt).toFixed(1)}%)`);
  check(ids.length === r.prompt, `turn ${t + 1}: /tokenize gives the prompt's ids`, [ids.length, r.prompt]);
  if (t) {
    check(r.cached >= MIN_SHARE * r.prompt && r.cached >= whole(turns[t - 1]),
      `turn ${t + 1}: ${r.cached} of ${r.prompt} prompt tokens cached (>= ${100 * MIN_SHARE}%, and >= ${whole(turns[t - 1])}: the previous turn whole)`);
    check(JSON.stringify(ids.slice(0, turns[t - 1].ids.length)) === JSON.stringify(turns[t - 1].ids),
      `turn ${t + 1}: the prompt begins with the previous turn's ids`);
  }
}
const want = TURNS * (TURNS - 1) / 2;
check(await srv.metric('kvlm_chat_answer_reuse_total') === want, `/metrics: ${want} answers reused`,
  await srv.metric('kvlm_chat_answer_reuse_total'));
await srv.stop();

let exact = 0;
for (let t = 0; t < TURNS; t++) {
  if (COLD === 'ends' && t && t !== TURNS - 1) continue;
  const cold = await serve();
  const c = await cold.client.completions.create(sampling({ prompt: turns[t].ids, logprobs: 5 }));
  await cold.stop();
  const same = c.choices[0].text === turns[t].answer;
  exact += same;
  const part = same ? null : parting(c.choices[0].logprobs, turns[t].answer);
  check(c.usage.prompt_tokens_details?.cached_tokens === 0 && (same || (NEAR_TIE > 0 && part?.near)),
    `turn ${t + 1}: the answer equals a cold run on its prompt ids${same ? '' : ` up to a near-tie at its token ${part?.at}`}`,
    [c.choices[0].text, turns[t].answer]);
}
console.log(`  ${LABEL}: ${exact} answers equal their cold run exactly`);
console.log(`${LABEL}: ${pass} passed, ${fail} failed`);
process.exit(fail ? 1 : 0);
