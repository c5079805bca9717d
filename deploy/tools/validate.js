#!/usr/bin/env node
// Validates Kubernetes manifests against the API types of Kubernetes 1.30 (npm kubernetes-types,
// generated from that release's OpenAPI spec) by type-checking them with the TypeScript compiler:
// an unknown field (excess property), a wrong type or a missing required field is an error.
//
//   node validate.js FILE_OR_KUSTOMIZATION_DIR...
// Directories are rendered first (render.js). Exit status 1 when anything is invalid.
'use strict';

const fs = require('fs');
const os = require('os');
const path = require('path');
const ts = require('typescript');
const YAML = require('yaml');
const { render, RenderError } = require('./render');

const KUBERNETES_VERSION = '1.30';

// apiVersion -> module of kubernetes-types ("v1" is the core group).
function moduleOf(apiVersion) {
  if (!apiVersion) return null;
  const [group, version] = apiVersion.includes('/') ? apiVersion.split('/') : ['core', apiVersion];
  const dir = group.replace(/\.k8s\.io$/, '').replace(/\.authorization$/, '');
  const file = path.join(__dirname, 'node_modules', 'kubernetes-types', dir, `${version}.d.ts`);
  return fs.existsSync(file) ? `kubernetes-types/${dir}/${version}` : null;
}

function load(input) {
  if (fs.statSync(input).isDirectory()) return render(input).map((doc, i) => ({ where: `${input} [${doc.kind}/${doc.metadata?.name}]`, doc, i }));
  return YAML.parseAllDocuments(fs.readFileSync(input, 'utf8')).map((d, i) => {
    if (d.errors.length) throw new RenderError(`${input}: document ${i}: ${d.errors[0].message}`);
    const doc = d.toJS();
    return { where: `${input} [${doc?.kind}/${doc?.metadata?.name}]`, doc, i };
  }).filter((x) => x.doc);
}

function main(inputs) {
  const docs = [];
  const problems = [];
  for (const input of inputs) {
    try {
      for (const d of load(input)) {
        if (d.doc.kind === 'Kustomization') continue;  // checked by render.js when rendered
        const mod = moduleOf(d.doc.apiVersion);
        if (!mod) problems.push(`${d.where}: apiVersion "${d.doc.apiVersion}" is not in Kubernetes ${KUBERNETES_VERSION}`);
        else if (!/^[A-Z][A-Za-z0-9]*$/.test(d.doc.kind || '')) problems.push(`${d.where}: no valid kind`);
        else docs.push({ ...d, mod });
      }
    } catch (e) {
      if (!(e instanceof RenderError)) throw e;
      problems.push(e.message);
    }
  }
  // One TypeScript file: a typed constant per document; each document's line range maps errors back.
  const lines = [];
  const imports = new Map();
  for (const d of docs) if (!imports.has(d.mod)) imports.set(d.mod, `m${imports.size}`);
  for (const [mod, alias] of imports) lines.push(`import type * as ${alias} from '${mod}';`);
  const ranges = [];
  docs.forEach((d, n) => {
    const start = lines.length + 1;
    const body = JSON.stringify(d.doc, null, 2).split('\n');
    lines.push(`export const doc${n}: ${imports.get(d.mod)}.${d.doc.kind} = ${body[0]}`, ...body.slice(1));
    ranges.push({ start, end: lines.length, d });
  });
  const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'shardcast-validate-'));
  const file = path.join(tmp, 'manifests.ts');
  fs.writeFileSync(file, lines.join('\n') + '\n');
  const program = ts.createProgram([file], {
    strict: true, noEmit: true, skipLibCheck: true, types: [],
    module: ts.ModuleKind.CommonJS, moduleResolution: ts.ModuleResolutionKind.Node10,
    baseUrl: __dirname, paths: { 'kubernetes-types/*': [path.join(__dirname, 'node_modules', 'kubernetes-types', '*')] },
  });
  for (const diag of ts.getPreEmitDiagnostics(program)) {
    const message = ts.flattenDiagnosticMessageText(diag.messageText, ' ');
    if (!diag.file || diag.file.fileName !== file) {
      problems.push(`typescript: ${message}`);
      continue;
    }
    const { line } = diag.file.getLineAndCharacterOfPosition(diag.start);
    const r = ranges.find((x) => line + 1 >= x.start && line + 1 <= x.end);
    const text = lines[line].trim();
    problems.push(`${r ? r.d.where : file}: at \`${text}\`: ${message}`);
  }
  fs.rmSync(tmp, { recursive: true, force: true });
  for (const p of problems) console.error(p);
  console.log(`validate: ${docs.length} object(s) against Kubernetes ${KUBERNETES_VERSION} API types: ` +
              (problems.length ? `${problems.length} problem(s)` : 'all valid'));
  return problems.length ? 1 : 0;
}

if (process.argv.length < 3) {
  console.error('usage: node validate.js FILE_OR_KUSTOMIZATION_DIR...');
  process.exit(2);
}
process.exit(main(process.argv.slice(2)));
