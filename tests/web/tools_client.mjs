// tests/web/tools_client.mjs: tool calls and reasoning through kvlm serve, driven by the official
// `openai` npm client (run by tests/cli_serve_tools.sh). KVLM_URL serves stories260K with a real
// chat template given by KVLM_TEMPLATE ("hermes": Qwen 2.5's; "r1": DeepSeek R1's, whose prompt
// opens <think>; "qwen3": Qwen 3's). The calls made are written to KVLM_CALLS (JSON) for the
// shell to validate against their tools' schemas with Python's jsonschema.
import OpenAI from 'openai';
import fs from 'node:fs';

const URL = process.env.KVLM_URL, KIND = process.env.KVLM_TEMPLATE, OUT = process.env.KVLM_CALLS;
const MODEL_ID = 'stories260K';
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

const TOOLS = [
  { type: 'function', function: { name: 'get_weather', description: 'The weather in a city',
    parameters: { type: 'object', properties: {
      city: { type: 'string', maxLength: 12 }, unit: { enum: ['celsius', 'fahrenheit'] },
      days: { type: 'integer', minimum: 1, maximum: 7 } }, required: ['city', 'days'] } } },
  { type: 'function', function: { name: 'search', description: 'Searches the web',
    parameters: { type: 'object', properties: { query: { type: 'string', maxLength: 16 },
      exact: { type: 'boolean' } }, required: ['query'] } } },
];
const made = [];  // every call made: [name, arguments text]
const USER = [{ role: 'user', content: 'What is the weather in Paris?' }];

// A stream's chunks added up as the SDK's users do: content, reasoning_content and the calls by index.
async function collect(stream) {
  const out = { content: '', reasoning: '', calls: [], finish: null, chunks: 0 };
  for await (const chunk of stream) {
    out.chunks++;
    const c = chunk.choices[0];
    if (!c) continue;
    ok(out.finish === null, 'a chunk after the finish_reason');
    out.content += c.delta.content ?? '';
    out.reasoning += c.delta.reasoning_content ?? '';
    for (const t of c.delta.tool_calls ?? []) {
      if (!out.calls[t.index]) {
        ok(t.id && t.type === 'function' && t.function?.name, 'a call\'s first delta has its id, type and name');
        out.calls[t.index] = { id: t.id, type: t.type, function: { name: t.function.name, arguments: '' } };
      } else ok(!t.id && !t.function?.name, 'a call\'s later delta has only arguments');
      out.calls[t.index].function.arguments += t.function?.arguments ?? '';
    }
    if (c.finish_reason) out.finish = c.finish_reason;
  }
  return out;
}

function calls_ok(calls, names) {
  ok(calls.length > 0, 'no tool call');
  for (const c of calls) {
    ok(names.includes(c.function.name), 'a call to ' + c.function.name);
    ok(/^call_[A-Za-z0-9]{24}$/.test(c.id), 'id ' + c.id);
    const args = JSON.parse(c.function.arguments);
    ok(args && typeof args === 'object' && !Array.isArray(args), 'arguments not an object: ' + c.function.arguments);
    made.push([c.function.name, c.function.arguments]);
  }
}

if (KIND === 'hermes') {
  for (const seed of [1, 2, 3, 4]) {
    await check(`tool_choice required (seed ${seed}): one call, arguments to the schema, finish_reason tool_calls`, async () => {
      const r = await client.chat.completions.create({ model: MODEL_ID, messages: USER, tools: TOOLS, tool_choice: 'required',
        parallel_tool_calls: false, seed, max_tokens: 400 });
      const m = r.choices[0].message;
      eq(r.choices[0].finish_reason, 'tool_calls', 'finish_reason ' + JSON.stringify(m));
      eq(m.tool_calls.length, 1, 'calls');
      eq(m.content, null, 'content');
      calls_ok(m.tool_calls, ['get_weather', 'search']);
    });
  }
  await check('a named function: only it is called', async () => {
    const r = await client.chat.completions.create({ model: MODEL_ID, messages: USER, tools: TOOLS,
      tool_choice: { type: 'function', function: { name: 'search' } }, parallel_tool_calls: false, seed: 9, max_tokens: 120 });
    calls_ok(r.choices[0].message.tool_calls, ['search']);
  });
  await check('parallel_tool_calls: several calls, each valid', async () => {
    const r = await client.chat.completions.create({ model: MODEL_ID, messages: USER, tools: TOOLS, tool_choice: 'required',
      seed: 5, max_tokens: 160, n: 2 });
    for (const ch of r.choices) {
      const m = ch.message;
      // a call cut by max_tokens stays in content; the whole ones are calls
      calls_ok(m.tool_calls, ['get_weather', 'search']);
      ok(ch.finish_reason === 'tool_calls' || ch.finish_reason === 'length', 'finish_reason ' + ch.finish_reason);
    }
  });
  for (const seed of [11, 12]) {
    await check(`streamed deltas add up to the answer given whole (seed ${seed})`, async () => {
      const body = { model: MODEL_ID, messages: USER, tools: TOOLS, tool_choice: 'required', parallel_tool_calls: false,
        seed, max_tokens: 400 };
      const whole = await client.chat.completions.create(body);
      const s = await collect(await client.chat.completions.create({ ...body, stream: true }));
      const m = whole.choices[0].message;
      eq(s.calls, m.tool_calls, 'calls');
      eq(s.content, m.content ?? '', 'content');
      eq(s.finish, whole.choices[0].finish_reason, 'finish_reason');
      ok(s.chunks > 4, 'the arguments came in pieces (' + s.chunks + ' chunks)');
    });
  }
  await check('a call, its result, the answer: the loop an agent runs', async () => {
    const first = await client.chat.completions.create({ model: MODEL_ID, messages: USER, tools: TOOLS,
      tool_choice: 'required', parallel_tool_calls: false, seed: 21, max_tokens: 120 });
    const call = first.choices[0].message;
    calls_ok(call.tool_calls, ['get_weather', 'search']);
    const msgs = [{ role: 'developer', content: 'Answer briefly.' }, ...USER, call,
      { role: 'tool', tool_call_id: call.tool_calls[0].id, content: '{"temperature": 22, "sky": "clear"}' }];
    const r = await client.chat.completions.create({ model: MODEL_ID, messages: msgs, tools: TOOLS, tool_choice: 'none',
      seed: 22, max_tokens: 16 });
    const m = r.choices[0].message;
    ok(typeof m.content === 'string' && m.content.length > 0, 'an answer: ' + JSON.stringify(m));
    eq(m.tool_calls, undefined, 'calls with tool_choice none');
    eq(r.choices[0].finish_reason, 'length', 'finish_reason');
    // the prompt holds the call and its result as the template renders them
    ok(r.usage.prompt_tokens > first.usage.prompt_tokens, 'the second prompt is longer');
  });
  await check('tool_choice auto: free text, a call only where one begins (lazy grammar)', async () => {
    for (const seed of [31, 32, 33]) {
      const r = await client.chat.completions.create({ model: MODEL_ID, messages: USER, tools: TOOLS, seed, max_tokens: 40 });
      const m = r.choices[0].message;
      if (m.tool_calls) calls_ok(m.tool_calls, ['get_weather', 'search']);
      else ok(typeof m.content === 'string', 'content');
    }
  });
  await check('refusals in OpenAI\'s shape', async () => {
    const bad = [
      [{ tools: [{ type: 'function', function: { description: 'no name' } }] }, 'tools'],
      [{ tools: TOOLS, tool_choice: { type: 'function', function: { name: 'nope' } } }, 'tool_choice'],
      [{ tool_choice: 'required' }, 'tool_choice'],
      [{ tools: TOOLS, parallel_tool_calls: 'yes' }, 'parallel_tool_calls'],
      [{ tools: [{ type: 'function', function: { name: 'f', parameters: { type: 'object', properties: { x: { not: {} } } } } }],
         tool_choice: 'required' }, 'tools'],
    ];
    for (const [extra, param] of bad) {
      let err = null;
      try { await client.chat.completions.create({ model: MODEL_ID, messages: USER, max_tokens: 4, ...extra }); }
      catch (e) { err = e; }
      ok(err && err.status === 400, 'a 400 for ' + JSON.stringify(extra));
      eq(err.error?.param ?? err.param, param, 'param');
    }
  });
}

if (KIND === 'llama3') {
  // Llama 3's calls open the answer with "{": a logit bias on "{" makes the tiny model start one, and the
  // lazy grammar (tool_choice auto) holds the rest to the schema from that first "{" on
  const tok = await (await fetch(URL + '/tokenize', { method: 'POST', headers: { 'Content-Type': 'application/json' },
    body: JSON.stringify({ content: '{', add_special: false }) })).json();
  const brace = tok.tokens[tok.tokens.length - 1];
  for (const seed of [41, 42, 43]) {
    await check(`auto, an answer that opens with "{" (seed ${seed}): a call held to the schema from there`, async () => {
      const r = await client.chat.completions.create({ model: MODEL_ID, messages: USER, tools: TOOLS, seed,
        max_tokens: 300, logit_bias: { [brace]: 40 } });
      const m = r.choices[0].message;
      eq(r.choices[0].finish_reason, 'tool_calls', 'finish_reason ' + JSON.stringify(m));
      calls_ok(m.tool_calls, ['get_weather', 'search']);
    });
  }
  await check('auto without the bias: text', async () => {
    const r = await client.chat.completions.create({ model: MODEL_ID, messages: USER, tools: TOOLS, seed: 44, max_tokens: 12 });
    const m = r.choices[0].message;
    ok(typeof m.content === 'string' && m.content.length > 0 && !m.tool_calls, 'content ' + JSON.stringify(m));
  });
}

if (KIND === 'r1' || KIND === 'qwen3') {
  // The tiny model never writes </think> by itself: a grammar makes it (llama.cpp's grammar field).
  const opened = KIND === 'r1';  // R1's generation prompt ends with <think>
  const grammar = (opened ? 'root ::= ' : 'root ::= "<think>" ') + '[a-z ]{3,24} "</think>" [a-z ]{3,24}';
  // this R1 template closes the reasoning in its prompt unless enable_thinking is set
  const kw = opened ? { chat_template_kwargs: { enable_thinking: true } } : {};
  await check(`${KIND}: reasoning_content and content split (whole)`, async () => {
    const r = await client.chat.completions.create({ model: MODEL_ID, messages: USER, grammar, seed: 7, max_tokens: 80, ...kw });
    const m = r.choices[0].message;
    ok(/^[a-z ]+$/.test(m.reasoning_content.trim()) && m.reasoning_content.trim().length >= 1, 'reasoning ' + JSON.stringify(m));
    ok(/^[a-z ]*$/.test(m.content) && !m.content.includes('think'), 'content ' + JSON.stringify(m.content));
  });
  await check(`${KIND}: streamed reasoning and content add up to the whole`, async () => {
    const body = { model: MODEL_ID, messages: USER, grammar, seed: 8, max_tokens: 80, ...kw };
    const whole = (await client.chat.completions.create(body)).choices[0].message;
    const s = await collect(await client.chat.completions.create({ ...body, stream: true }));
    eq(s.reasoning, whole.reasoning_content, 'reasoning');
    eq(s.content, whole.content, 'content');
  });
  if (opened) {
    await check('r1: a prompt that opened the reasoning, an answer cut inside it: all reasoning', async () => {
      const r = await client.chat.completions.create({ model: MODEL_ID, messages: USER, seed: 3, max_tokens: 12, ...kw });
      const m = r.choices[0].message;
      ok(m.reasoning_content && m.reasoning_content.length > 0, 'reasoning ' + JSON.stringify(m));
      eq(m.content, '', 'content');
    });
  }
}

if (OUT) fs.writeFileSync(OUT, JSON.stringify({ tools: TOOLS, calls: made }));
console.log(`${pass} passed, ${fail} failed`);
process.exit(fail ? 1 : 0);
