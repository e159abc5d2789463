// tests/web/openai_client.mjs: kvlm serve driven by the official `openai` npm client:
// completions and chat, streaming and not, n > 1, stop strings, logprobs, usage, models,
// 32 concurrent streams; greedy and seeded texts are checked against `kvlm run` alone.
// Run by tests/cli_serve_openai.sh with KVLM_URL, KVLM_BIN and KVLM_MODEL set.
import OpenAI from 'openai';
import { execFileSync } from 'node:child_process';
import path from 'node:path';

const URL = process.env.KVLM_URL, KVLM = process.env.KVLM_BIN, MODEL = process.env.KVLM_MODEL;
const MODEL_ID = path.basename(MODEL).replace(/\.[^.]*$/, '');
const client = new OpenAI({ baseURL: URL + '/v1', apiKey: 'x', maxRetries: 0, timeout: 60000 });

let pass = 0, fail = 0;
async function check(name, fn) {
  try { await fn(); pass++; console.log('ok   ' + name); }
  catch (e) { fail++; console.log('FAIL ' + name + ': ' + (e.stack || e)); }
}
function eq(got, want, what) {
  if (JSON.stringify(got) !== JSON.stringify(want))
    throw new Error(`${what}: got ${JSON.stringify(got)}, want ${JSON.stringify(want)}`);
}
function ok(cond, what) { if (!cond) throw new Error(what); }

// The text `kvlm run` generates after PROMPT (it echoes the prompt and ends with a newline).
const refCache = new Map();
function run(prompt, n, sampling) {
  const args = ['run', '-m', MODEL, '-p', prompt, '-n', String(n), '-t', '1', ...sampling];
  const key = args.join('\0');
  if (!refCache.has(key)) {
    const out = execFileSync(KVLM, args, { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] });
    ok(out.startsWith(prompt) && out.endsWith('\n'), 'kvlm run output does not echo the prompt: ' + JSON.stringify(out));
    refCache.set(key, out.slice(prompt.length, -1));
  }
  return refCache.get(key);
}
const greedy = (prompt, n) => run(prompt, n, ['--temp', '0']);
function nTokens(text) {  // prompt tokens as kvlm counts them (BOS included)
  return execFileSync(KVLM, ['tokenize', '-m', MODEL, text], { encoding: 'utf8' }).trim().split(/\s+/).length;
}
const plain = (msgs) => msgs.map((m) => ({ system: 'System', user: 'User', assistant: 'Assistant' }[m.role] + ': ' + m.content + '\n')).join('') + 'Assistant:';

// Reads a stream, returning the text of each choice index, the finish reasons and the usage chunk.
async function collect(stream, field) {
  const texts = [], finish = [], roles = [];
  let usage = null, chunks = 0;
  for await (const chunk of stream) {
    chunks++;
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      ok(finish[c.index] === undefined, `choice ${c.index}: content after its finish_reason`);
      const piece = field === 'text' ? c.text : c.delta?.content;
      texts[c.index] = (texts[c.index] ?? '') + (piece ?? '');
      if (c.delta?.role) roles[c.index] = c.delta.role;
      if (c.finish_reason) finish[c.index] = c.finish_reason;
    }
  }
  return { texts, finish, roles, usage, chunks };
}

const P1 = 'Once upon a time';
const P2 = 'Lily and Tom went to the park to play with their red ball. They';

await check('models.list names the model file', async () => {
  const models = [];
  for await (const m of client.models.list()) models.push(m);
  eq(models.map((m) => m.id), [MODEL_ID], 'model ids');
  eq(models[0].object, 'model', 'object');
});

await check('models.retrieve: the model, and NotFoundError for another id', async () => {
  const m = await client.models.retrieve(MODEL_ID);
  eq([m.id, m.object], [MODEL_ID, 'model'], 'retrieved');
  let err = null;
  try { await client.models.retrieve('gpt-4'); } catch (e) { err = e; }
  ok(err instanceof OpenAI.NotFoundError && err.code === 'model_not_found', `another id: ${err}`);
});

await check('ids are cmpl- and chatcmpl- with 32 random hex digits, with a system_fingerprint', async () => {
  const a = await client.completions.create({ model: MODEL_ID, prompt: P1, max_tokens: 1 });
  const b = await client.chat.completions.create({ model: MODEL_ID, messages: [{ role: 'user', content: 'Hi' }], max_tokens: 1 });
  ok(/^cmpl-[0-9a-f]{32}$/.test(a.id) && /^chatcmpl-[0-9a-f]{32}$/.test(b.id), `ids ${a.id} ${b.id}`);
  ok(/^fp_[0-9a-f]{10}$/.test(a.system_fingerprint) && a.system_fingerprint === b.system_fingerprint, 'fingerprint');
});

await check('completion, greedy, stopped by length', async () => {
  const r = await client.completions.create({ model: MODEL_ID, prompt: P2, max_tokens: 16, temperature: 0 });
  eq(r.object, 'text_completion', 'object');
  eq(r.choices.length, 1, 'choices');
  eq(r.choices[0].text, greedy(P2, 16), 'text vs kvlm run');
  eq(r.choices[0].finish_reason, 'length', 'finish_reason');
  eq([r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens], [nTokens(P2), 16, nTokens(P2) + 16], 'usage');
});

await check('completion, sampled with a seed: the text of kvlm run with that seed', async () => {
  const r = await client.completions.create({ model: MODEL_ID, prompt: P1, max_tokens: 120, temperature: 0.8, top_p: 0.9,
                                              top_k: 40, min_p: 0.05, seed: 42 });
  eq(r.choices[0].text, run(P1, 120, ['--temp', '0.8', '--top-p', '0.9', '--top-k', '40', '--min-p', '0.05', '--seed', '42']),
     'text vs kvlm run --seed 42');
  eq(r.choices[0].finish_reason, 'length', 'finish_reason');
});

await check('streamed completion equals the non-streamed one', async () => {
  const args = { model: MODEL_ID, prompt: P2, max_tokens: 40, temperature: 0.9, seed: 11 };
  const whole = await client.completions.create(args);
  const s = await collect(await client.completions.create({ ...args, stream: true, stream_options: { include_usage: true } }), 'text');
  ok(s.chunks > 2, 'only ' + s.chunks + ' chunks: not streamed');
  eq(s.texts, [whole.choices[0].text], 'streamed text');
  eq(s.finish, [whole.choices[0].finish_reason], 'finish_reason');
  eq(s.usage?.completion_tokens, whole.usage.completion_tokens, 'streamed usage (stream_options.include_usage)');
});

await check('n = 3 greedy: three identical choices equal to kvlm run', async () => {
  const r = await client.completions.create({ model: MODEL_ID, prompt: P2, max_tokens: 24, temperature: 0, n: 3 });
  eq(r.choices.map((c) => c.index).sort(), [0, 1, 2], 'indexes');
  for (const c of r.choices) eq(c.text, greedy(P2, 24), 'choice ' + c.index);
  eq(r.usage.completion_tokens, 3 * 24, 'completion_tokens over all choices');
});

await check('n = 4 sampled: choices differ, and the same seed repeats them', async () => {
  const args = { model: MODEL_ID, prompt: P1, max_tokens: 32, temperature: 1.0, seed: 1234, n: 4 };
  const a = await client.completions.create(args), b = await client.completions.create(args);
  const texts = (r) => r.choices.slice().sort((x, y) => x.index - y.index).map((c) => c.text);
  ok(new Set(texts(a)).size > 1, 'all 4 samples identical: ' + JSON.stringify(texts(a)));
  eq(texts(b), texts(a), 'same seed, same choices');
  const s = await collect(await client.completions.create({ ...args, stream: true }), 'text');
  eq(s.texts, texts(a), 'streamed choices');
});

await check('stop strings: the text ends before the stop string, finish_reason stop', async () => {
  const ref = greedy(P1, 60);
  const words = ref.split(' ').filter((w) => /^[a-z]{3,}$/.test(w));
  ok(words.length >= 3, 'reference too short: ' + JSON.stringify(ref));
  const stop = words[2] + ' ' + ref.slice(ref.indexOf(words[2]) + words[2].length + 1).split(' ')[0];  // two words
  ok(ref.includes(stop), 'stop string ' + JSON.stringify(stop) + ' not in ' + JSON.stringify(ref));
  const want = ref.slice(0, ref.indexOf(stop));
  const args = { model: MODEL_ID, prompt: P1, max_tokens: 60, temperature: 0, stop: ['not in the text', stop] };
  const r = await client.completions.create(args);
  eq(r.choices[0].text, want, 'text with stop ' + JSON.stringify(stop));
  eq(r.choices[0].finish_reason, 'stop', 'finish_reason');
  const s = await collect(await client.completions.create({ ...args, stream: true }), 'text');
  eq(s.texts, [want], 'streamed text (no part of the stop string may leak)');
  eq(s.finish, ['stop'], 'streamed finish_reason');
  const one = await client.completions.create({ ...args, stop: stop });
  eq(one.choices[0].text, want, 'stop as a single string');
});

await check('logprobs: the greedy token is the most likely alternative', async () => {
  const r = await client.completions.create({ model: MODEL_ID, prompt: P2, max_tokens: 12, temperature: 0, logprobs: 3 });
  const lp = r.choices[0].logprobs;
  ok(lp, 'no logprobs in ' + JSON.stringify(r.choices[0]));
  eq(lp.tokens.length, 12, 'tokens');
  eq(lp.token_logprobs.length, 12, 'token_logprobs');
  eq(lp.tokens.join(''), r.choices[0].text, 'tokens joined');
  lp.token_logprobs.forEach((x, i) => {
    ok(x <= 0 && x > -100, `token_logprobs[${i}] = ${x}`);
    const top = Object.values(lp.top_logprobs[i]);
    ok(top.length >= 1 && top.length <= 3, `top_logprobs[${i}] has ${top.length} entries`);
    ok(Math.abs(Math.max(...top) - x) < 1e-4, `greedy token ${i} (${x}) is not the top alternative (${top})`);
  });
});

await check('chat logprobs: one entry per token, the greedy token on top', async () => {
  const r = await client.chat.completions.create({ model: MODEL_ID, messages: [{ role: 'user', content: 'Hello' }],
                                                   max_tokens: 10, temperature: 0, logprobs: true, top_logprobs: 2 });
  const content = r.choices[0].logprobs?.content;
  ok(Array.isArray(content), 'no logprobs.content in ' + JSON.stringify(r.choices[0]));
  eq(content.length, r.usage.completion_tokens, 'entries');
  eq(content.map((e) => e.token).join(''), r.choices[0].message.content, 'tokens joined');
  for (const e of content) {
    ok(e.top_logprobs.length === 2, 'top_logprobs ' + JSON.stringify(e));
    ok(e.logprob <= 0 && Math.abs(Math.max(...e.top_logprobs.map((t) => t.logprob)) - e.logprob) < 1e-4,
       'greedy token not on top: ' + JSON.stringify(e));
    eq(Buffer.from(e.bytes).toString('utf8'), e.token, 'bytes of ' + JSON.stringify(e.token));
  }
});

await check('cached prompt tokens: a repeated prompt is served from the prefix index', async () => {
  const prompt = 'The old owl lived in a tall tree near the river. Every night he watched the stars and told stories to the young birds who came to listen.';
  const first = await client.completions.create({ model: MODEL_ID, prompt, max_tokens: 4, temperature: 0 });
  const second = await client.completions.create({ model: MODEL_ID, prompt, max_tokens: 4, temperature: 0 });
  const cached = (r) => r.usage.prompt_tokens_details?.cached_tokens ?? 0;
  const n = nTokens(prompt);
  eq(first.usage.prompt_tokens, n, 'prompt_tokens');
  eq(cached(first), 0, 'cached tokens of a new prompt');
  ok(cached(second) >= 16 * Math.floor((n - 1) / 16) && cached(second) < n,
     `cached tokens of the repeat: ${cached(second)} of ${n}`);
  eq(second.choices[0].text, first.choices[0].text, 'text from the cached prefix');
});

await check('chat, greedy: the plain template, the text of kvlm run', async () => {
  const messages = [{ role: 'system', content: 'You tell short stories.' }, { role: 'user', content: 'Tell me about a cat.' }];
  const r = await client.chat.completions.create({ model: MODEL_ID, messages, max_tokens: 30, temperature: 0 });
  eq(r.object, 'chat.completion', 'object');
  eq(r.choices[0].message.role, 'assistant', 'role');
  const named = JSON.stringify(r).match(/"(?:chat_)?template"\s*:\s*"([^"]*)"/);
  ok(named && named[1] === 'plain', 'the response does not name the plain fallback template: ' + JSON.stringify(r));
  eq(r.choices[0].message.content, greedy(plain(messages), 30), 'content vs kvlm run on the rendered prompt');
  eq(r.usage.prompt_tokens, nTokens(plain(messages)), 'prompt_tokens');
});

await check('chat: streamed equals non-streamed, multi-turn', async () => {
  const messages = [{ role: 'user', content: 'Hi!' }, { role: 'assistant', content: 'Hello. Once upon a time' },
                    { role: 'user', content: 'Go on.' }];
  const args = { model: MODEL_ID, messages, max_tokens: 30, temperature: 0.7, seed: 3 };
  const whole = await client.chat.completions.create(args);
  const s = await collect(await client.chat.completions.create({ ...args, stream: true }), 'delta');
  ok(s.chunks > 2, 'only ' + s.chunks + ' chunks: not streamed');
  eq(s.roles, ['assistant'], 'delta role');
  eq(s.texts, [whole.choices[0].message.content], 'streamed content');
  eq(s.finish, [whole.choices[0].finish_reason], 'finish_reason');
  const g = await client.chat.completions.create({ ...args, temperature: 0, n: 2 });
  eq(g.choices.map((c) => c.message.content), Array(2).fill(greedy(plain(messages), 30)), 'greedy n = 2 vs kvlm run');
});

await check('errors come back as OpenAI errors the client understands', async () => {
  const expectStatus = async (args, status, what) => {
    try { await client.completions.create(args); } catch (e) {
      ok(e instanceof OpenAI.APIError, what + ': not an APIError: ' + e);
      eq(e.status, status, what + ' status');
      ok(typeof e.error?.message === 'string' && e.error.message.length > 0, what + ': no error message');
      return;
    }
    throw new Error(what + ': no error');
  };
  await expectStatus({ model: 'no-such-model', prompt: 'x', max_tokens: 4 }, 404, 'unknown model');
  await expectStatus({ model: MODEL_ID, prompt: 'x', max_tokens: 0 }, 400, 'max_tokens 0');
});

await check('32 concurrent streaming greedy requests each equal their prompt run alone', async () => {
  const names = ['Lily', 'Tom', 'Sue', 'Ben', 'Max', 'Anna', 'Sam', 'Mia'];
  const starts = ['saw a', 'wanted to', 'was very', 'and the dog'];
  const prompts = names.flatMap((n) => starts.map((s) => `${n} ${s}`));
  const streams = await Promise.all(prompts.map((prompt) =>
    client.completions.create({ model: MODEL_ID, prompt, max_tokens: 24, temperature: 0, stream: true })));
  const got = await Promise.all(streams.map((s) => collect(s, 'text')));
  const bad = prompts.filter((p, i) => got[i].texts[0] !== greedy(p, 24));
  ok(bad.length === 0, `${bad.length} of 32 differ from kvlm run, e.g. ${JSON.stringify(bad[0])}: ` +
     JSON.stringify(got[prompts.indexOf(bad[0])]?.texts[0]) + ' vs ' + JSON.stringify(bad[0] && greedy(bad[0], 24)));
});

console.log(`${pass} passed, ${fail} failed`);
process.exit(fail ? 1 : 0);
