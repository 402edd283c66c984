"""A small MCP server over stdio for `tests/mcp_tools_test.py`, written with the SDK's server API.

Run as `python server.py [--fail-start] [--http PORT]` (stdio; with --http, streamable HTTP at
http://127.0.0.1:PORT/mcp). Its tools cover what the client
must handle: plain results, arguments of several types, a tool error (`isError`), a slow async
tool (concurrency and timeouts), a crash of the whole process, and non-text content.
"""
import argparse
import asyncio
import base64
import os
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--fail-start", action="store_true", help="exit with an error before serving")
parser.add_argument("--http", type=int, default=0, help="serve streamable HTTP on this port of 127.0.0.1")
args = parser.parse_args()
if args.fail_start:
  print("test server: refusing to start (--fail-start)", file=sys.stderr)
  sys.exit(2)

# After the arguments: --fail-start ends before the SDK's import (most of a start's time).
try:  # mcp >= 2
  from mcp.server.mcpserver import MCPServer as Server
  from mcp.server.mcpserver.exceptions import ToolError
except ImportError:  # mcp 1.x
  from mcp.server.fastmcp import FastMCP as Server
  from mcp.server.fastmcp.exceptions import ToolError
from mcp import types  # noqa: E402

server = Server("jaxagent-test-server", log_level="WARNING")


@server.tool()
def add(a: int, b: int) -> int:
  """Adds two integers."""
  return a + b


@server.tool()
def echo(text: str, times: int = 1) -> str:
  """Repeats a text."""
  return text * times


@server.tool()
async def sleep(seconds: float) -> str:
  """Sleeps, then says how long."""
  await asyncio.sleep(seconds)
  return f"slept {seconds}"


@server.tool()
def fail(message: str) -> str:
  """Always fails with `message` (an `isError` result)."""
  raise ToolError(message)


@server.tool()
def crash() -> str:
  """Ends the server process at once, mid-call."""
  os._exit(3)


@server.tool()
def pid() -> int:
  """The server's process id."""
  return os.getpid()


@server.tool()
def env_value(key: str) -> str:
  """An environment variable of the server process, and its working directory."""
  return f"{os.environ.get(key, '<unset>')} in {os.getcwd()}"


@server.tool()
def media() -> list:
  """An image, a text resource, a binary resource and some text."""
  png = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(92)).decode()
  return [
      types.TextContent.model_validate({"type": "text", "text": "here is a picture"}),
      types.ImageContent.model_validate({"type": "image", "data": png, "mimeType": "image/png"}),
      types.EmbeddedResource.model_validate({"type": "resource", "resource": {
          "uri": "file:///notes.txt", "mimeType": "text/plain", "text": "resource text"}}),
      types.EmbeddedResource.model_validate({"type": "resource", "resource": {
          "uri": "file:///data.bin", "mimeType": "application/octet-stream",
          "blob": base64.b64encode(bytes(10)).decode()}}),
  ]


if __name__ == "__main__":
  if not args.http:
    server.run()
  elif hasattr(server, "settings") and hasattr(server.settings, "port"):  # mcp 1.x: host and port are settings
    server.settings.host, server.settings.port = "127.0.0.1", args.http
    server.run("streamable-http")
  else:
    server.run("streamable-http", host="127.0.0.1", port=args.http)
