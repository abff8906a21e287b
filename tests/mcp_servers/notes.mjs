// A minimal MCP server in node, for the sandbox test: one JSON-RPC message a line over
// stdio. `note {text}` appends to notes.txt in its working directory; `fetch {url}` GETs
// a URL (the test's loopback server) and answers its body.
import { appendFileSync } from "node:fs";
import { createInterface } from "node:readline";
import { get } from "node:http";

const tools = [
  { name: "note", description: "Append text to notes.txt.", inputSchema: { type: "object" } },
  { name: "fetch", description: "GET a URL.", inputSchema: { type: "object" } },
];

function text(id, value) {
  return { jsonrpc: "2.0", id, result: { content: [{ type: "text", text: value }], isError: false } };
}

function call(id, name, args, reply) {
  if (name === "note") {
    appendFileSync("notes.txt", `${args.text}\n`);
    reply(text(id, `noted in ${process.cwd()}`));
  } else if (name === "fetch") {
    get(args.url, (res) => {
      let body = "";
      res.on("data", (chunk) => (body += chunk));
      res.on("end", () => reply(text(id, `fetched: ${body}`)));
    }).on("error", (err) => reply(text(id, `fetch failed: ${err.message}`)));
  } else {
    reply({ jsonrpc: "2.0", id, error: { code: -32602, message: `unknown tool ${name}` } });
  }
}

const reply = (message) => process.stdout.write(JSON.stringify(message) + "\n");
createInterface({ input: process.stdin }).on("line", (line) => {
  if (!line.trim()) return;
  const message = JSON.parse(line);
  if (!("id" in message)) return; // a notification
  const params = message.params || {};
  if (message.method === "initialize") {
    reply({
      jsonrpc: "2.0",
      id: message.id,
      result: {
        protocolVersion: params.protocolVersion || "2025-06-18",
        capabilities: { tools: {} },
        serverInfo: { name: "notes", version: "1" },
      },
    });
  } else if (message.method === "tools/list") {
    reply({ jsonrpc: "2.0", id: message.id, result: { tools } });
  } else if (message.method === "tools/call") {
    call(message.id, params.name, params.arguments || {}, reply);
  } else if (message.method === "ping") {
    reply({ jsonrpc: "2.0", id: message.id, result: {} });
  } else {
    reply({ jsonrpc: "2.0", id: message.id, error: { code: -32601, message: "unknown method" } });
  }
});
