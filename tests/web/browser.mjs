// tests/web/browser.mjs: the page at / in headless Chromium (Debian's, driven by
// playwright-core): a message typed in the chat box streams its answer in, the KV cache
// view follows the request (blocks in use rise, a request row appears), and a second
// turn reuses the first one's blocks (prefix hits rise). With KVLM_PAGE_KEY (the server run
// with --api-key): without the key the page says it needs one, and given it as #key=KEY it
// sends it on every call (the same checks then pass). Run by tests/cli_serve_browser.sh.
import { chromium } from 'playwright-core';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';

const URL = process.env.KVLM_URL;
const KEY = process.env.KVLM_PAGE_KEY;
const shot = process.env.KVLM_SCREENSHOT;  // where to save a screenshot of the page (optional)
let pass = 0, fail = 0;
function check(name, cond, detail) {
  if (cond) { pass++; console.log('ok   ' + name); } else { fail++; console.log('FAIL ' + name + ': ' + detail); }
}

// A fresh profile: the closed network refuses Chromium's background connections otherwise.
const profile = fs.mkdtempSync(path.join(os.tmpdir(), 'kvlm-chromium-'));
const browser = await chromium.launchPersistentContext(profile, {
  executablePath: process.env.KVLM_CHROMIUM || '/usr/bin/chromium', headless: true,
  viewport: { width: 1280, height: 800 },
  args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
         '--disable-background-networking', '--disable-component-update', '--disable-sync'],
});
try {
  const page = await browser.newPage();
  const errors = [];
  page.on('pageerror', (e) => errors.push(e.message));
  page.on('console', (m) => { if (m.type() === 'error') errors.push(m.text()); });
  // Poll the status every 5 ms (the page's default is 300 ms): the answer lasts a second or two.
  if (KEY) {
    await page.goto(URL + '/?poll=5');
    const asked = await page.waitForFunction(() => document.querySelector('#health-text').textContent === 'API key needed',
                                             null, { timeout: 10000 }).then(() => true, () => false);
    check('without the key the page says it needs one', asked, await page.textContent('#health-text'));
    errors.length = 0; /* the browser logs the 401s */
    await page.goto(URL + '/index.html?poll=5#key=' + encodeURIComponent(KEY));
    check('the key is taken out of the address', !page.url().includes('key='), page.url());
    await page.waitForFunction(() => document.querySelector('#health-text').textContent === 'serving', null,
                               { timeout: 10000 });
    errors.length = 0; /* 401s of the keyless page may be logged late; any from here on count */
  } else await page.goto(URL + '/?poll=5');
  await page.waitForFunction(() => document.querySelector('#kv-blocks-used').textContent !== '–', null, { timeout: 10000 });
  const model = await page.textContent('#model-name');
  check('the page shows the model and the block pool', model === (process.env.KVLM_PAGE_MODEL || 'stories260K') &&
        await page.locator('#kv-grid > div').count() > 0, `model ${model}`);

  // Record every length of the streamed answer and every status the KV view shows.
  await page.evaluate(() => {
    const log = window.__log = { lens: [], used: [], rows: 0 };
    new MutationObserver(() => {
      const a = document.querySelector('.msg.assistant .content');
      if (a && a.textContent.length !== log.lens.at(-1)) log.lens.push(a.textContent.length);
      log.used.push(Number(document.querySelector('#kv-blocks-used').dataset.value));
      log.rows = Math.max(log.rows, document.querySelectorAll('#kv-requests tr[data-id]').length);
    }).observe(document.body, { subtree: true, childList: true, characterData: true, attributes: true });
  });
  const before = Number(await page.getAttribute('#kv-blocks-used', 'data-value'));
  const question = 'Once upon a time there was a little girl named Lily who loved to play in the park with her dog. ' +
                   'Tell me what happened one sunny day.';
  /* long enough for a browser on a loaded machine to see it stream (cli_serve_browser.sh's model) */
  await page.fill('#max-tokens', process.env.KVLM_PAGE_TOKENS || '1500');
  await page.fill('#temperature', '0'); /* greedy: this question's answer runs them all */
  await page.fill('#chat-input', question);
  await page.press('#chat-input', 'Enter');
  await page.waitForSelector('.msg.assistant[data-done]', { timeout: 60000 });
  const log = await page.evaluate(() => window.__log);
  const answer = await page.textContent('.msg.assistant .content');
  const lens = log.lens.filter((n) => n > 0);
  check('the answer streams in', new Set(lens).size >= 2 && answer.length > 0,
        `lengths seen ${JSON.stringify(log.lens)}, answer ${JSON.stringify(answer)}`);
  check('the question is shown', (await page.textContent('.msg.user .content')) === question, 'no user message');
  const meta = await page.textContent('.msg.assistant .meta');
  check('the answer ends with its token count and finish reason', /\d+ tokens .*finish: (stop|length)/.test(meta), meta);
  console.log('     blocks in use seen during the request: ' + JSON.stringify([...new Set(log.used)]));
  check('blocks in use rise during the request', Math.max(...log.used) > before,
        `before ${before}, seen ${JSON.stringify([...new Set(log.used)])}`);
  check('the request appears in the request table', log.rows > 0, 'no row');
  await page.waitForFunction(() => Number(document.querySelector('#kv-running').dataset.value) === 0 &&
                               !document.querySelector('#kv-requests tr[data-id]'), null, { timeout: 5000 });
  check('the finished request leaves its blocks cached for reuse',
        Number(await page.getAttribute('#kv-grid', 'data-cached')) > 0 &&
        await page.locator('#kv-grid > div[data-state="cached"]').count() > 0,
        'grid ' + JSON.stringify(await page.evaluate(() => ({ ...document.querySelector('#kv-grid').dataset }))));

  // A second turn starts with the first one's prompt: its blocks come from the prefix index.
  const hitsBefore = Number(await page.getAttribute('#kv-hits', 'data-value'));
  await page.fill('#max-tokens', '64'); /* the history fits the 2,048 */
  await page.fill('#chat-input', 'And then?');
  await page.click('#send');
  await page.waitForSelector('.msg.assistant:nth-of-type(4)[data-done]', { timeout: 60000 });
  await page.waitForFunction((h) => Number(document.querySelector('#kv-hits').dataset.value) > h, hitsBefore, { timeout: 5000 })
    .catch(() => {});
  const hits = Number(await page.getAttribute('#kv-hits', 'data-value'));
  const meta2 = await page.textContent('.msg.assistant:nth-of-type(4) .meta');
  check('the second turn reuses cached prompt blocks', hits > hitsBefore && /cached\)/.test(meta2),
        `prefix hits ${hitsBefore} -> ${hits}; ${meta2}`);
  check('no error in the page', errors.length === 0, errors.join(' | '));
  if (shot) { await page.screenshot({ path: shot }); console.log('screenshot: ' + shot); }
} finally {
  await browser.close();
  fs.rmSync(profile, { recursive: true, force: true });
}
console.log(`${pass} passed, ${fail} failed`);
process.exit(fail ? 1 : 0);
