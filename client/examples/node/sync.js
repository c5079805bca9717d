#!/usr/bin/env node
// Triggers a Shardcast sync from Node.js and waits for it to complete, printing its progress:
// the same gRPC API as the C++ and Python clients, loaded at run time from proto/.
//
//   npm install
//   node sync.js --src trainer --dst vllm --version 7 [--daemon unix:/run/shardcast/shardcastd.sock] [--verify]
//
// Exit codes follow the `shardcast` CLI: 0 committed, 2 usage, 4 daemon unreachable, 5 sync failed.
'use strict';

const path = require('path');
const crypto = require('crypto');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_ROOT = process.env.SHARDCAST_PROTO_DIR || path.resolve(__dirname, '../../../proto');

function usage(message) {
  if (message) console.error(`sync.js: ${message}`);
  console.error('usage: node sync.js --src GROUP --dst GROUP --version N [--daemon TARGET] [--verify] [--timeout-s S]');
  process.exit(2);
}

function parseArgs(argv) {
  const args = { verify: false, timeoutS: 0 };
  for (let i = 0; i < argv.length; i++) {
    const flag = argv[i];
    const value = () => (i + 1 < argv.length ? argv[++i] : usage(`${flag} needs a value`));
    if (flag === '--src') args.src = value();
    else if (flag === '--dst') args.dst = value();
    else if (flag === '--version') args.version = value();
    else if (flag === '--daemon') args.daemon = value();
    else if (flag === '--timeout-s') args.timeoutS = Number(value());
    else if (flag === '--verify') args.verify = true;
    else if (flag === '--help' || flag === '-h') usage();
    else usage(`unknown argument ${flag}`);
  }
  if (!args.src || !args.dst || !args.version) usage('--src, --dst and --version are required');
  if (!/^[1-9][0-9]*$/.test(args.version)) usage('--version must be a positive integer');
  return args;
}

// Same default as every Shardcast client: $SHARDCAST_ADDRESS, $SHARDCAST_SOCKET, the node's socket.
function defaultTarget() {
  const t = process.env.SHARDCAST_ADDRESS || process.env.SHARDCAST_SOCKET || '/run/shardcast/shardcastd.sock';
  return t.startsWith('/') ? `unix:${t}` : t;
}

function loadService() {
  const def = protoLoader.loadSync('shardcast/v1/service.proto', {
    includeDirs: [PROTO_ROOT],
    keepCase: true,   // field names as in the .proto (src_group, bytes_done, ...)
    longs: String,    // uint64 as decimal strings: byte counts exceed 2^53
    defaults: true,
  });
  return grpc.loadPackageDefinition(def).shardcast.v1.Shardcast;
}

function gib(bytes) {
  return (Number(bytes) / 2 ** 30).toFixed(2);
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const target = args.daemon ? (args.daemon.startsWith('/') ? `unix:${args.daemon}` : args.daemon) : defaultTarget();
  const Shardcast = loadService();
  const client = new Shardcast(target, grpc.credentials.createInsecure());

  await new Promise((resolve) => {
    client.waitForReady(Date.now() + 5000, (err) => {
      if (err) {
        console.error(`sync.js: shardcastd at "${target}" is not reachable: ${err.message}`);
        process.exit(4);
      }
      resolve();
    });
  });

  const syncId = `node-${crypto.randomBytes(4).toString('hex')}`;
  // Follow the sync while it runs; the Sync call's own answer decides the outcome.
  const watch = client.Watch({ sync_id: syncId });
  watch.on('data', (p) => {
    console.error(`[${syncId}] ${p.state.padEnd(10)} ${gib(p.bytes_done)}/${gib(p.bytes_total)} GiB` +
                  ` wave ${p.waves_done}/${p.waves}` + (p.error ? ` error: ${p.error}` : ''));
  });
  // The stream ends by itself after the sync's last state; NOT_FOUND when the sync fails before it
  // starts, CANCELLED if it is cut below.
  const watchEnded = new Promise((resolve) => {
    watch.on('end', resolve);
    watch.on('error', resolve);
  });

  const request = {
    src_group: args.src,
    dst_group: args.dst,
    version: args.version,
    sync_id: syncId,
    options: { verify: args.verify, timeout_ms: Math.round(args.timeoutS * 1000) },
  };
  const deadline = Date.now() + ((args.timeoutS || 300) + 30) * 1000;
  client.Sync(request, { deadline }, async (err, res) => {
    // Let the stream deliver the final state (it may trail the answer), then stop following.
    await Promise.race([watchEnded, new Promise((resolve) => setTimeout(resolve, 2000))]);
    watch.cancel();
    if (err) {
      console.error(`sync.js: sync failed: ${grpc.status[err.code]}: ${err.details}`);
      process.exit(err.code === grpc.status.UNAVAILABLE && /connect/i.test(err.details) ? 4 : 5);
    }
    const seconds = Number(res.seconds);
    console.log(JSON.stringify({
      sync_id: res.sync_id,
      version: res.version,
      network_bytes: res.network_bytes,
      seconds,
      gbps: seconds > 0 ? Number(res.network_bytes) / seconds / 1e9 : 0,
      plan_cached: res.plan_cached,
    }));
    client.close();
  });
}

main();
