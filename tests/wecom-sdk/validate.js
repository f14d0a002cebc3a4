// The official WeCom Node SDK (@wecom/aibot-node-sdk 1.0.7) against imgate's WeCom simulator
// (tests/common/wecom.rs). Run by the ignored test
// `the_official_node_sdk_works_against_the_simulator` in tests/wecom.rs:
//
//   WECOM_BOT_ID=… WECOM_SECRET=… node validate.js <ws_url>      (or WECOM_WS_URL=…)
//
// Subscribes, then on the first text message: a finished stream reply on its req_id, a
// proactive markdown send to its chat, the download and decryption of an image message (the
// test pushes one), an upload of a file (UPLOAD_BYTES bytes, byte i = i % 251) and a send of it,
// then HEARTBEAT_MS × 5 more with the link up: the SDK drops a link whose pings go unanswered.
// One JSON line per step on stdout; the SDK's log goes to stderr. Exit 0 when every step
// succeeded, 1 with the error otherwise, 2 after 30 s.
'use strict';

const crypto = require('crypto');
const { WSClient } = require('@wecom/aibot-node-sdk');

const wsUrl = process.argv[2] || process.env.WECOM_WS_URL;
const botId = process.env.WECOM_BOT_ID;
const secret = process.env.WECOM_SECRET;
const uploadBytes = Number(process.env.UPLOAD_BYTES || 600 * 1024);
const heartbeatMs = Number(process.env.HEARTBEAT_MS || 1000);
if (!wsUrl || !botId || !secret) {
  console.error('usage: WECOM_BOT_ID=… WECOM_SECRET=… node validate.js <ws_url>');
  process.exit(1);
}

const line = (o) => process.stdout.write(JSON.stringify(o) + '\n');
const fail = (step, err, code = 1) => {
  line({ step, ok: false, error: err && err.message ? err.message : String(err), detail: err });
  process.exit(code);
};
// Not unref'd: it also keeps node from ending quietly with 0 when the SDK gives up.
setTimeout(() => fail('timeout', new Error('not done within 30 s'), 2), 30000);

const err = (...a) => console.error(...a);
const logger = { debug: err, info: err, warn: err, error: err };
const client = new WSClient({
  botId,
  secret,
  wsUrl,
  logger,
  heartbeatInterval: heartbeatMs,
  maxAuthFailureAttempts: 1,
  maxReconnectAttempts: 1,
});

// The image message may come before or after the text one is handled.
let gotImage;
const image = new Promise((resolve) => (gotImage = resolve));
client.on('message.image', (frame) => gotImage(frame));
client.on('error', (e) => {
  err('sdk error:', e && e.message);
  // A refused subscribe or a link that cannot be made again: the SDK stops trying.
  if (e && /EXHAUSTED/.test(e.code || '')) fail('connection', e);
});
client.on('authenticated', () => line({ step: 'subscribe', ok: true }));
let disconnects = 0;
client.on('disconnected', (reason) => {
  disconnects++;
  err('disconnected:', reason);
});

let started = false;
client.on('message.text', (frame) => {
  if (started) return;
  started = true;
  run(frame).catch((e) => fail('run', e));
});

async function step(name, f) {
  try {
    const out = await f();
    line({ step: name, ok: true, ...out });
  } catch (e) {
    fail(name, e);
  }
}

async function run(frame) {
  const body = frame.body;
  const chatid = body.chatid || body.from.userid;
  await step('reply', async () => {
    const streamId = `stream_${Date.now()}`;
    const ack = await client.replyStream(frame, streamId, `echo: ${body.text.content}`, true);
    return { req_id: frame.headers.req_id, stream_id: streamId, errcode: ack.errcode };
  });
  await step('send', async () => {
    const ack = await client.sendMessage(chatid, {
      msgtype: 'markdown',
      markdown: { content: '**proactive** from the official SDK' },
    });
    return { chatid, req_id: ack.headers.req_id, errcode: ack.errcode };
  });
  await step('download', async () => {
    const timer = new Promise((_, reject) => setTimeout(() => reject(new Error('no image message within 15 s')), 15000));
    const img = await Promise.race([image, timer]);
    const { buffer, filename } = await client.downloadFile(img.body.image.url, img.body.image.aeskey);
    return { req_id: img.headers.req_id, filename, bytes: buffer.length, base64: buffer.toString('base64') };
  });
  let mediaId;
  await step('upload', async () => {
    const data = Buffer.alloc(uploadBytes);
    for (let i = 0; i < uploadBytes; i++) data[i] = i % 251;
    const res = await client.uploadMedia(data, { type: 'file', filename: 'sdk-upload.bin' });
    mediaId = res.media_id;
    return {
      media_id: res.media_id,
      type: res.type,
      created_at: res.created_at,
      bytes: uploadBytes,
      md5: crypto.createHash('md5').update(data).digest('hex'),
    };
  });
  await step('send_media', async () => {
    const ack = await client.sendMediaMessage(chatid, 'file', mediaId);
    return { chatid, media_id: mediaId, errcode: ack.errcode };
  });
  await step('heartbeat', async () => {
    await new Promise((r) => setTimeout(r, heartbeatMs * 5));
    if (disconnects > 0 || !client.isConnected) throw new Error(`link lost ${disconnects} time(s) meanwhile`);
    return { interval_ms: heartbeatMs };
  });
  client.disconnect();
  line({ step: 'done', ok: true });
  process.exit(0);
}

client.connect();
