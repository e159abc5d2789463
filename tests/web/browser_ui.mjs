// tests/web/browser_ui.mjs: the web page's chat controls in headless Chromium (Debian's, driven
// by playwright-core): the system prompt and sampling settings arrive in the request's body
// (and the server takes them), regenerate replaces the last answer, edit re-sends the edited
// question, answers render as markdown while script, event-handler and javascript: payloads
// stay inert (answers crafted here: the request is routed and answered with an SSE stream),
// conversations survive a reload and switch and delete, and a long prompt shows its prefill
// progress (from /kvlm/status) while the server reads it. Run by tests/cli_serve_browser_ui.sh.
import { chromium } from 'playwright-core';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';

const URL = process.env.KVLM_URL;
const QUICK = !!process.env.KVLM_TEST_QUICK;
let pass = 0, fail = 0;
function check(name, cond, detail) {
  if (cond) { pass++; console.log('ok   ' + name); } else { fail++; console.log('FAIL ' + name + ': ' + detail); }
}
const J = (x) => JSON.stringify(x);
const T0 = Date.now();
const took = (what) => console.log(`     ${what}: ${((Date.now() - T0) / 1000).toFixed(1)} s`);

const profile = fs.mkdtempSync(path.join(os.tmpdir(), 'kvlm-chromium-'));
const browser = await chromium.launchPersistentContext(profile, {
  executablePath: process.env.KVLM_CHROMIUM || '/usr/bin/chromium', headless: true,
  viewport: { width: 1400, height: 900 },
  args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
         '--disable-background-networking', '--disable-component-update', '--disable-sync'],
});
try {
  await browser.grantPermissions(['clipboard-read', 'clipboard-write'], { origin: URL });
  const page = await browser.newPage();
  const errors = [], dialogs = [], foreign = [], bodies = [];
  page.on('pageerror', (e) => errors.push(e.message));
  page.on('console', (m) => { if (m.type() === 'error') errors.push(m.text()); });
  page.on('dialog', (d) => { dialogs.push(d.message()); d.dismiss().catch(() => {}); });
  page.on('request', (r) => {
    if (!r.url().startsWith(URL + '/') && !r.url().startsWith('data:')) foreign.push(r.url());
    if (r.method() === 'POST' && r.url().endsWith('/v1/chat/completions')) bodies.push(r.postDataJSON());
  });
  took('browser started');
  await page.goto(URL + '/?poll=5');
  await page.waitForFunction(() => document.querySelector('#kv-blocks-used').textContent !== '–', null, { timeout: 10000 });
  const answers = () => page.$$eval('#messages .msg.assistant .content', (a) => a.map((x) => x.textContent.trim()));
  const questions = () => page.$$eval('#messages .msg.user .content', (a) => a.map((x) => x.textContent));
  const convTitles = () => page.$$eval('#conv-list li[data-id] .conv-open', (a) => a.map((x) => x.firstChild.textContent));
  const waitDone = (n) => page.waitForFunction((n) => document.querySelectorAll('.msg.assistant[data-done]').length === n &&
    !document.querySelector('.msg.streaming'), n, { timeout: 30000 });

  // 1. The system prompt and sampling settings, sent to the real server.
  const SYSTEM = 'You are a terse test assistant.';
  await page.click('#settings summary');
  await page.fill('#system-prompt', SYSTEM);
  await page.fill('#top-p', '0.9');
  await page.fill('#top-k', '20');
  await page.fill('#min-p', '0.1');
  await page.fill('#seed', '1234');
  await page.fill('#max-tokens', '5');
  await page.fill('#temperature', '0.5');
  await page.fill('#chat-input', 'Hello there');
  await page.press('#chat-input', 'Enter');
  await waitDone(1);
  const b1 = bodies.at(-1) || {};
  check('the system prompt and the question are the request\'s messages',
        J(b1.messages) === J([{ role: 'system', content: SYSTEM }, { role: 'user', content: 'Hello there' }]), J(b1.messages));
  check('the sampling settings are in the request', b1.temperature === 0.5 && b1.top_p === 0.9 && b1.top_k === 20 &&
        b1.min_p === 0.1 && b1.seed === 1234 && b1.max_tokens === 5 && b1.stream === true, J(b1));
  const meta1 = await page.textContent('.msg.assistant .meta');
  check('the server answers the request with them', /5 tokens .*finish: length/.test(meta1), meta1);

  took('settings done');
  // 2. Crafted answers from here on: the request is answered with an SSE stream made here.
  const queue = [];
  await page.route('**/v1/chat/completions', async (route) => {
    const text = queue.shift() ?? 'unexpected request';
    if (typeof text === 'object') return route.fulfill({ status: text.status, contentType: 'application/json',
                                                         body: J({ error: { message: text.message } }) });
    const pieces = text.match(/[\s\S]{1,7}/g) || [];
    const ev = (o) => 'data: ' + J(o) + '\n\n';
    const base = { id: 'chatcmpl-crafted', object: 'chat.completion.chunk', created: 0, model: 'crafted' };
    let body = ev({ ...base, choices: [{ index: 0, delta: { role: 'assistant', content: '' } }] });
    for (const p of pieces) body += ev({ ...base, choices: [{ index: 0, delta: { content: p } }] });
    body += ev({ ...base, choices: [{ index: 0, delta: {}, finish_reason: 'stop' }] }) + 'data: [DONE]\n\n';
    await route.fulfill({ status: 200, headers: { 'Content-Type': 'text/event-stream' }, body });
  });
  await page.click('#new-chat');
  check('New chat empties the chat box', (await page.locator('#messages .msg').count()) === 0, 'messages left');
  const MD = '# A heading\n\nSome **bold** text and `inline code`.\n\n```python\nprint("hi <b>")\n```\n\n' +
    '<script>window.__pwned = "script"</script>\n\n<img src="x" onerror="window.__pwned=\'img\';alert(\'img\')">\n\n' +
    '[a link](javascript:window.__pwned=\'link\') and <a href="javascript:alert(\'raw\')" id="rawlink">raw</a>\n\n' +
    '<svg><g onload="window.__pwned=\'svg\'"></g></svg><iframe src="javascript:alert(\'frame\')"></iframe>\n\n' +
    '<details open ontoggle="window.__pwned=\'toggle\'"><summary>x</summary>y</details>\n';
  queue.push(MD);
  await page.fill('#chat-input', 'Show me markdown');
  await page.click('#send');
  await waitDone(1);
  await page.waitForTimeout(200); // an onerror or ontoggle that would run has run by now
  const md = await page.evaluate(() => {
    const c = document.querySelector('.msg.assistant .content');
    return { code: c.querySelector('pre > code')?.textContent.trim(), h1: c.querySelector('h1')?.textContent,
             bold: c.querySelector('strong')?.textContent, inline: c.querySelector('p code')?.textContent,
             bad: [...c.querySelectorAll('script, img, iframe, [onerror], [onload], [ontoggle]')].map((e) => e.outerHTML),
             hrefs: [...c.querySelectorAll('a')].map((a) => a.getAttribute('href')), pwned: window.__pwned };
  });
  check('markdown renders (a heading, bold, inline code, a code block as <pre><code>)',
        md.code === 'print("hi <b>")' && md.h1 === 'A heading' && md.bold === 'bold' && md.inline === 'inline code', J(md));
  check('no script, img, iframe or event handler survives the sanitiser', md.bad.length === 0, J(md.bad));
  check('no javascript: link survives', md.hrefs.every((h) => h === null || !/^\s*javascript:/i.test(h)), J(md.hrefs));
  for (const a of await page.$$('.msg.assistant .content a')) await a.click().catch(() => {});
  await page.waitForTimeout(100);
  const pwned = await page.evaluate(() => window.__pwned);
  check('the payloads stay inert (no dialog, no global set)', pwned === undefined && dialogs.length === 0,
        `__pwned ${pwned}, dialogs ${J(dialogs)}`);
  await page.click('.msg.assistant pre .copy');
  const clip = await page.evaluate(() => navigator.clipboard.readText());
  check('a code block\'s Copy button copies its code', clip === 'print("hi <b>")', J(clip));

  // 3. Regenerate: the last answer is asked for again and replaced.
  const nBodies = bodies.length;
  queue.push('The regenerated answer.');
  await page.click('.msg.assistant .regenerate');
  await waitDone(1);
  const b3 = bodies.at(-1);
  check('Regenerate re-sends the conversation without its last answer', bodies.length === nBodies + 1 &&
        J(b3.messages) === J([{ role: 'system', content: SYSTEM }, { role: 'user', content: 'Show me markdown' }]), J(b3?.messages));
  check('Regenerate replaces the last answer', J(await answers()) === J(['The regenerated answer.']), J(await answers()));

  // 4. Edit: the last question is edited and sent again; its old answer goes.
  queue.push('An answer to the edited question.');
  await page.click('.msg.user .edit');
  await page.fill('.msg.user .edit-input', 'An edited question');
  await page.click('.msg.user .edit-send');
  await waitDone(1);
  const b4 = bodies.at(-1);
  check('Edit re-sends the edited question in place of the old one',
        J(b4.messages) === J([{ role: 'system', content: SYSTEM }, { role: 'user', content: 'An edited question' }]), J(b4.messages));
  check('the edited question and its new answer replace the old ones',
        J(await questions()) === J(['An edited question']) && J(await answers()) === J(['An answer to the edited question.']),
        J([await questions(), await answers()]));

  took('markdown, regenerate, edit done');
  // Retry: a question whose answer failed stays, and is sent again.
  queue.push({ status: 503, message: 'crafted failure' }, 'An answer at the second try.');
  await page.click('.msg.assistant .regenerate');
  await page.waitForSelector('.msg.error');
  const err = await page.textContent('.msg.error .content');
  check('a failed answer shows the error, the question stays with Retry', /crafted failure \(503\)/.test(err) &&
        (await answers()).length === 0 && await page.isVisible('.msg.user .regenerate'), err);
  errors.length = 0; /* the browser logs the 503 */
  await page.click('.msg.user .regenerate');
  await waitDone(1);
  check('Retry sends the question again', J(bodies.at(-1).messages.at(-1)) === J({ role: 'user', content: 'An edited question' }) &&
        J(await answers()) === J(['An answer at the second try.']) && !(await page.$('.msg.error')), J(await answers()));

  // 5. Conversations: kept in localStorage, they survive a reload, switch, and go when deleted.
  const before = await convTitles();
  check('the list holds both conversations, the newest first', J(before) === J(['An edited question', 'Hello there']), J(before));
  await page.reload();
  await page.waitForSelector('#conv-list li[data-id]');
  const after = await convTitles();
  check('the conversations survive a reload', J(after) === J(before), J(after));
  check('the reloaded page shows the conversation it showed', J(await questions()) === J(['An edited question']) &&
        J(await answers()) === J(['An answer at the second try.']), J([await questions(), await answers()]));
  check('the settings survive a reload', await page.inputValue('#system-prompt') === SYSTEM &&
        await page.inputValue('#top-k') === '20' && await page.inputValue('#seed') === '1234',
        J([await page.inputValue('#system-prompt'), await page.inputValue('#top-k'), await page.inputValue('#seed')]));
  await page.click('#conv-list li:has-text("Hello there") .conv-open');
  check('a conversation in the list switches the chat to it', J(await questions()) === J(['Hello there']) &&
        (await answers()).length === 1 && /5 tokens .*finish: length/.test(await page.textContent('.msg.assistant .meta')),
        J([await questions(), await answers()]));
  await page.click('#conv-list li:has-text("An edited question") .conv-delete');
  check('Delete removes a conversation', J(await convTitles()) === J(['Hello there']), J(await convTitles()));
  await page.reload();
  await page.waitForSelector('#conv-list li[data-id]');
  check('the deletion is kept', J(await convTitles()) === J(['Hello there']), J(await convTitles()));
  const page2 = await browser.newPage();  // a second tab: its list follows what the first one keeps
  page2.on('pageerror', (e) => errors.push('second tab: ' + e.message));
  await page2.goto(URL + '/?poll=1000');
  await page2.waitForSelector('#conv-list li[data-id]');
  queue.push('An answer seen from the other tab.');
  await page.click('#new-chat');
  await page.fill('#chat-input', 'From the first tab');
  await page.click('#send');
  await waitDone(1);
  const tabs = await page2.waitForFunction(() => document.querySelectorAll('#conv-list li[data-id]').length === 2, null,
                                           { timeout: 5000 }).then(() => true, () => false);
  const titles2 = await page2.$$eval('#conv-list li[data-id] .conv-open', (a) => a.map((x) => x.firstChild.textContent));
  check('a second tab\'s list follows the first one\'s', tabs && J(titles2) === J(['From the first tab', 'Hello there']), J(titles2));
  await page2.close();

  took('conversations done');
  // 6. The prefill bar: a long prompt (never sent before: nothing of it is cached) on the real server.
  await page.unroute('**/v1/chat/completions');
  await page.click('#new-chat');
  await page.fill('#max-tokens', '1');
  await page.evaluate(() => {
    const log = window.__prefill = [];
    new MutationObserver(() => {
      const box = document.querySelector('#prefill');
      if (!box.hidden) log.push([Number(box.dataset.done), Number(box.dataset.total),
                                 document.querySelector('#prefill-progress').value]);
    }).observe(document.querySelector('#prefill'), { subtree: true, childList: true, characterData: true, attributes: true });
  });
  const reps = Number(process.env.KVLM_PAGE_PREFILL_REPS || (QUICK ? 24 : 60));
  const long = `Request ${Date.now()}: ` + 'The little dog ran to the park and played with a red ball. '.repeat(reps);
  await page.fill('#chat-input', long);
  await page.click('#send');
  await waitDone(1);
  const seen = await page.evaluate(() => window.__prefill);
  const partial = seen.filter(([d, t, v]) => t > 0 && d < t && v === d);
  console.log(`     prefill progress seen: ${J(seen.slice(0, 12))}${seen.length > 12 ? ' …' : ''}`);
  check('the prefill bar shows the prompt being read', partial.length > 0 && partial.every(([, t]) => t >= reps * 20), J(seen));
  check('the prefill bar goes once the answer comes', await page.isHidden('#prefill'), 'still shown');

  took('prefill done');
  // 7. The page as a build without the libraries makes it (-DKVLM_WEB_MARKDOWN=OFF: the source
  // file, its placeholders empty): answers show as plain text, the payloads as text too.
  await page.route(URL + '/', (route) => route.fulfill({ status: 200, contentType: 'text/html; charset=utf-8',
    body: fs.readFileSync(new globalThis.URL('../../src/server/web/index.html', import.meta.url)) }));
  await page.route('**/v1/chat/completions', (route) => route.fulfill({ status: 200,
    headers: { 'Content-Type': 'text/event-stream' }, body: 'data: ' + J({ id: 'x', choices: [{ index: 0, delta: { content: MD } }] }) +
    '\n\ndata: ' + J({ id: 'x', choices: [{ index: 0, delta: {}, finish_reason: 'stop' }] }) + '\n\ndata: [DONE]\n\n' }));
  await page.goto(URL + '/');
  await page.click('#new-chat');
  await page.fill('#chat-input', 'Plain, please');
  await page.click('#send');
  await waitDone(1);
  await page.waitForTimeout(100);
  const plain = await page.evaluate(() => ({ text: document.querySelector('.msg.assistant .content').textContent,
    elements: document.querySelector('.msg.assistant .content').childElementCount, pwned: window.__pwned }));
  check('without the libraries an answer shows as plain text', plain.text === MD && plain.elements === 0 &&
        plain.pwned === undefined && dialogs.length === 0, J(plain));
  took('plain text done');

  check('the page made no request elsewhere', foreign.length === 0, J(foreign));
  check('no error in the page', errors.length === 0, errors.join(' | '));
} finally {
  await browser.close();
  fs.rmSync(profile, { recursive: true, force: true });
}
console.log(`${pass} passed, ${fail} failed`);
process.exit(fail ? 1 : 0);
