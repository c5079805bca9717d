#!/usr/bin/env node
// Renders a kustomization directory to its Kubernetes objects, for CI machines without kustomize.
// It implements the subset Shardcast's manifests use — `resources` (files and directories),
// `namespace`, and `patches` given as JSON 6902 operations with a `target` — and refuses anything
// else, so nothing is silently ignored. Where `kubectl` exists, the tests compare its output with
// `kubectl kustomize`.
//
//   node render.js DIR [--json]      (YAML documents on stdout, or one JSON array)
'use strict';

const fs = require('fs');
const path = require('path');
const YAML = require('yaml');

const SUPPORTED = new Set(['apiVersion', 'kind', 'namespace', 'resources', 'patches']);
// Objects that are not namespaced (kustomize leaves their namespace alone).
const CLUSTER_SCOPED = new Set(['Namespace', 'ClusterRole', 'ClusterRoleBinding', 'CustomResourceDefinition',
  'PriorityClass', 'StorageClass', 'PersistentVolume', 'RuntimeClass', 'IngressClass']);

class RenderError extends Error {}

function readDocs(file) {
  return YAML.parseAllDocuments(fs.readFileSync(file, 'utf8')).map((d, i) => {
    if (d.errors.length) throw new RenderError(`${file}: document ${i}: ${d.errors[0].message}`);
    return d.toJS();
  }).filter((d) => d !== null && d !== undefined);
}

// RFC 6901 pointer -> path segments ("~1" is "/", "~0" is "~").
function segments(pointer) {
  if (pointer === '') return [];
  if (!pointer.startsWith('/')) throw new RenderError(`JSON pointer "${pointer}" must start with "/"`);
  return pointer.slice(1).split('/').map((s) => s.replace(/~1/g, '/').replace(/~0/g, '~'));
}

function parentOf(doc, pointer, op) {
  const segs = segments(pointer);
  if (segs.length === 0) throw new RenderError(`${op} of the whole document is not supported`);
  let node = doc;
  for (const s of segs.slice(0, -1)) {
    const key = Array.isArray(node) ? Number(s) : s;
    if (node === null || typeof node !== 'object' || !(key in node))
      throw new RenderError(`${op} ${pointer}: "${s}" does not exist`);
    node = node[key];
  }
  return [node, segs[segs.length - 1]];
}

// RFC 6902 add / remove / replace / test.
function applyOp(doc, op) {
  const [parent, last] = parentOf(doc, op.path, op.op);
  const isArray = Array.isArray(parent);
  const index = isArray ? (last === '-' ? parent.length : Number(last)) : last;
  switch (op.op) {
    case 'add':
      if (!('value' in op)) throw new RenderError(`add ${op.path}: no value`);
      if (isArray) {
        if (!(index >= 0 && index <= parent.length)) throw new RenderError(`add ${op.path}: index out of range`);
        parent.splice(index, 0, op.value);
      } else parent[index] = op.value;
      return;
    case 'remove':
    case 'replace':
      if (!(index in parent)) throw new RenderError(`${op.op} ${op.path}: nothing there`);
      if (op.op === 'remove') isArray ? parent.splice(index, 1) : delete parent[index];
      else parent[index] = op.value;
      return;
    case 'test':
      if (JSON.stringify(parent[index]) !== JSON.stringify(op.value))
        throw new RenderError(`test ${op.path}: value differs`);
      return;
    default:
      throw new RenderError(`patch operation "${op.op}" is not supported (add, remove, replace, test)`);
  }
}

function matches(obj, target) {
  for (const key of Object.keys(target)) {
    if (!['kind', 'name', 'namespace', 'group', 'version'].includes(key))
      throw new RenderError(`patch target field "${key}" is not supported`);
  }
  const [group, version] = (obj.apiVersion || '').includes('/') ? obj.apiVersion.split('/') : ['', obj.apiVersion];
  return (!target.kind || target.kind === obj.kind) && (!target.name || target.name === obj.metadata?.name) &&
         (!target.namespace || target.namespace === obj.metadata?.namespace) &&
         (target.group === undefined || target.group === group) && (!target.version || target.version === version);
}

function render(dir) {
  const file = ['kustomization.yaml', 'kustomization.yml', 'Kustomization'].map((f) => path.join(dir, f)).find(fs.existsSync);
  if (!file) throw new RenderError(`${dir}: no kustomization.yaml`);
  const k = readDocs(file)[0] || {};
  for (const key of Object.keys(k)) {
    if (!SUPPORTED.has(key)) throw new RenderError(`${file}: "${key}" is not supported by this renderer (${[...SUPPORTED].join(', ')})`);
  }
  let objects = [];
  for (const r of k.resources || []) {
    const p = path.resolve(dir, r);
    if (!fs.existsSync(p)) throw new RenderError(`${file}: resource "${r}" does not exist`);
    objects = objects.concat(fs.statSync(p).isDirectory() ? render(p) : readDocs(p));
  }
  if (k.namespace) {
    for (const o of objects) {
      if (!CLUSTER_SCOPED.has(o.kind)) o.metadata = { ...o.metadata, namespace: k.namespace };
    }
  }
  for (const [i, p] of (k.patches || []).entries()) {
    if (!p.target) throw new RenderError(`${file}: patch ${i} needs a target (only JSON 6902 patches are supported)`);
    const text = p.path ? fs.readFileSync(path.resolve(dir, p.path), 'utf8') : p.patch;
    const ops = YAML.parse(text);
    if (!Array.isArray(ops)) throw new RenderError(`${file}: patch ${i} is not a list of JSON 6902 operations`);
    const hits = objects.filter((o) => matches(o, p.target));
    if (hits.length === 0) throw new RenderError(`${file}: patch ${i} matches no resource (${JSON.stringify(p.target)})`);
    for (const o of hits) {
      for (const op of ops) {
        try {
          applyOp(o, op);
        } catch (e) {
          throw new RenderError(`${file}: patch ${i} on ${o.kind}/${o.metadata?.name}: ${e.message}`);
        }
      }
    }
  }
  const seen = new Set();
  for (const o of objects) {
    const id = `${o.kind}/${o.metadata?.namespace || ''}/${o.metadata?.name}`;
    if (seen.has(id)) throw new RenderError(`${file}: ${id} is defined twice`);
    seen.add(id);
  }
  return objects;
}

if (require.main === module) {
  const args = process.argv.slice(2);
  const json = args.includes('--json');
  const dirs = args.filter((a) => a !== '--json');
  if (dirs.length !== 1) {
    console.error('usage: node render.js DIR [--json]');
    process.exit(2);
  }
  try {
    const objects = render(dirs[0]);
    process.stdout.write(json ? JSON.stringify(objects, null, 2) + '\n'
                              : objects.map((o) => YAML.stringify(o)).join('---\n'));
  } catch (e) {
    if (!(e instanceof RenderError)) throw e;
    console.error(`render: ${e.message}`);
    process.exit(1);
  }
}

module.exports = { render, RenderError };
