"""A hand-written stdio JSON-RPC server whose tool list is malformed (an argument of type
"float", which JSON Schema does not have), for `tests/mcp_tools_test.py`. It answers only
`initialize` and `tools/list`, as much of MCP as a client needs to read the list."""
import json
import sys

TOOLS = [{"name": "scale", "description": "Scales a number.",
          "inputSchema": {"type": "object", "properties": {"x": {"type": "float"}}, "required": ["x"]}}]

for line in sys.stdin:
  message = json.loads(line)
  if "id" not in message:
    continue  # a notification
  if message["method"] == "initialize":
    result = {"protocolVersion": message["params"]["protocolVersion"], "capabilities": {"tools": {}},
              "serverInfo": {"name": "malformed", "version": "0"}}
  elif message["method"] == "tools/list":
    result = {"tools": TOOLS}
  else:
    print(json.dumps({"jsonrpc": "2.0", "id": message["id"],
                      "error": {"code": -32601, "message": "method not found"}}), flush=True)
    continue
  print(json.dumps({"jsonrpc": "2.0", "id": message["id"], "result": result}), flush=True)
