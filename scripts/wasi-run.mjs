// Runs a wasm32-wasip1 test binary (cargo's target runner for the wasm tier of the tests):
// the pure core, compiled to the instruction set the filter ships in, executed under Node's
// WASI preview1. Usage: node scripts/wasi-run.mjs <file.wasm> [args...]
//
// The test binary links the proxy-wasm SDK, whose host functions (module "env") exist only
// inside Envoy. The pure core never calls them, so each is a stub that fails loudly if it is.
import { readFile } from "node:fs/promises";
import { WASI } from "node:wasi";
import { argv, env, exit } from "node:process";

const [file, ...args] = argv.slice(2);
const wasi = new WASI({ version: "preview1", args: [file, ...args], env, returnOnExit: true });
const module = await WebAssembly.compile(await readFile(file));
const imports = wasi.getImportObject();
for (const imp of WebAssembly.Module.imports(module)) {
  if (imp.kind !== "function" || imp.module.startsWith("wasi_")) continue;
  imports[imp.module] ??= {};
  imports[imp.module][imp.name] = () => {
    throw new Error(`host function ${imp.module}.${imp.name} called outside Envoy`);
  };
}
const instance = await WebAssembly.instantiate(module, imports);
// A program linking the filter's library (an example, not a test) also carries the plugin's
// `_initialize` export, which Node refuses next to `_start`; the program only needs `_start`.
const { _initialize, ...exports } = instance.exports;
exit(wasi.start(_initialize === undefined ? instance : { exports }));
