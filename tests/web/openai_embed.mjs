// tests/web/openai_embed.mjs: kvlm serve --embeddings driven by the official `openai` npm
// client's embeddings.create: one string, many, token ids, base64 (the client's default: it
// decodes the vectors itself), dimensions; each vector as `kvlm embed` gives it alone.
// Run by tests/cli_serve_embed.sh with KVLM_URL, KVLM_BIN and KVLM_MODEL set.
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
function ok(cond, what) { if (!cond) throw new Error(what); }
// `kvlm embed` alone: the vector of one input (-p TEXT or --ids IDS)
function alone(args) {
  const out = execFileSync(KVLM, ['embed', '-m', MODEL, '-t', '1', ...args], { encoding: 'utf8' });
  return out.trim().split(/\s+/).map(Number);
}
function close(got, want, what) {
  ok(got.length === want.length, `${what}: ${got.length} values, want ${want.length}`);
  const top = Math.max(...want.map(Math.abs));
  const err = Math.max(...got.map((v, i) => Math.abs(v - want[i]))) / top;
  ok(err <= 1e-6, `${what}: differs by ${err}`);
}

const texts = ['The quick brown fox', 'jumps over the lazy dog', 'a'];
await check('embeddings.create, one string (base64 on the wire, decoded by the client)', async () => {
  const r = await client.embeddings.create({ model: MODEL_ID, input: texts[0] });
  ok(r.object === 'list' && r.data.length === 1 && r.data[0].object === 'embedding' && r.data[0].index === 0, 'shape');
  close(r.data[0].embedding, alone(['-p', texts[0]]), 'vector');
  ok(r.usage.prompt_tokens > 0 && r.usage.total_tokens === r.usage.prompt_tokens, 'usage');
  ok(r.model === MODEL_ID, 'model');
});
await check('embeddings.create, many strings, encoding_format float', async () => {
  const r = await client.embeddings.create({ model: MODEL_ID, input: texts, encoding_format: 'float' });
  ok(r.data.length === 3, 'three vectors');
  for (let i = 0; i < 3; i++) {
    ok(r.data[i].index === i, 'index');
    close(r.data[i].embedding, alone(['-p', texts[i]]), `vector ${i}`);
  }
});
await check('embeddings.create, token ids and arrays of them', async () => {
  const ids = [5, 17, 42, 99, 7];
  const one = await client.embeddings.create({ model: MODEL_ID, input: ids });
  close(one.data[0].embedding, alone(['--ids', ids.join(' ')]), 'ids');
  ok(one.usage.prompt_tokens === ids.length, 'usage counts the ids');
  const two = await client.embeddings.create({ model: MODEL_ID, input: [ids, [8, 9]] });
  close(two.data[1].embedding, alone(['--ids', '8 9']), 'second array');
});
await check('embeddings.create, dimensions: the first values, unit length', async () => {
  const r = await client.embeddings.create({ model: MODEL_ID, input: texts[1], dimensions: 16 });
  ok(r.data[0].embedding.length === 16, 'length 16');
  close(r.data[0].embedding, alone(['-p', texts[1], '--dimensions', '16']), 'vector');
  const n = Math.sqrt(r.data[0].embedding.reduce((a, v) => a + v * v, 0));
  ok(Math.abs(n - 1) < 1e-5, 'unit length');
});
await check('embeddings.create: 32 at once, each as alone', async () => {
  const inputs = Array.from({ length: 32 }, (_, i) => `input number ${i} says ${'ab'.repeat(i % 7)}`);
  const rs = await Promise.all(inputs.map((input) => client.embeddings.create({ model: MODEL_ID, input })));
  for (const i of [0, 13, 31]) close(rs[i].data[0].embedding, alone(['-p', inputs[i]]), `request ${i}`);
});
await check('embeddings.create: an unknown model is a 404 the client raises', async () => {
  let status = 0;
  try { await client.embeddings.create({ model: 'nope', input: 'x' }); } catch (e) { status = e.status; }
  ok(status === 404, `status ${status}`);
});

console.log(`${pass} passed, ${fail} failed`);
process.exit(fail ? 1 : 0);
