-- Lua for haproxy.cfg: ask epick where each request goes (POST /v1/route), then let the
-- epick_endpoint backend send it there; a filter reads usage and TTFT from the answer and,
-- at its end, queues the CompletionReport, which one background task sends to
-- /v1/completion over a kept-alive connection.
-- Needs HAProxy >= 2.5 (Lua filters, core.register_task at run time); Debian 12 ships 2.6.

local ROUTE_URL = os.getenv("EPICK_ROUTE_URL") or "http://127.0.0.1:9005/v1/route"
local COMPLETION_URL = os.getenv("EPICK_COMPLETION_URL")
    or "http://127.0.0.1:9005/v1/completion"
local FAILURE_MODE = os.getenv("EPICK_FAILURE_MODE") or "closed"
-- A JSON answer larger than this is passed through unread (no usage reported).
local MAX_JSON = 4194304

-- "http://ip:port/path" -> ip, port, path (epick is addressed by IP: no DNS at run time).
local function parse_url(url)
    local ip, port, path = url:match("^http://%[?([^/%]]-)%]?:(%d+)(/.*)$")
    if not ip then
        error("epick.lua: " .. url .. " is not http://IP:PORT/PATH")
    end
    return ip, tonumber(port), path
end
local ROUTE_IP, ROUTE_PORT, ROUTE_PATH = parse_url(ROUTE_URL)
local REPORT_IP, REPORT_PORT, REPORT_PATH = parse_url(COMPLETION_URL)

local SKIP = { host = true, ["content-length"] = true, ["content-type"] = true,
               connection = true, ["transfer-encoding"] = true, ["keep-alive"] = true,
               expect = true }
local TYPES = { [400] = "invalid_request_error", [413] = "invalid_request_error",
                [429] = "rate_limit_exceeded", [503] = "service_unavailable" }

local function json_string(s)
    return '"' .. s:gsub('[%c"\\]', function(c)
        return string.format("\\u%04x", c:byte())
    end) .. '"'
end

-- The client gets an OpenAI-style error; 429/503 keep epick's reason header.
local function fail(txn, status, message, reason)
    local headers = { ["content-type"] = { "application/json" } }
    if reason and reason ~= "" then
        headers["x-llm-d-request-dropped-reason"] = { reason }
    end
    txn:done(txn:reply({ status = status, headers = headers,
        body = '{"error":{"message":' .. json_string(message) .. ',"type":"'
            .. (TYPES[status] or "server_error") .. '","code":' .. status .. "}}" }))
end

-- HAProxy's clock in µs, an integer (a variable keeps integers, not fractions).
local function now_us()
    local now = core.now()
    return now.sec * 1000000 + now.usec
end

local function split(address)
    local ip, port = address:match("^%[?(.-)%]?:(%d+)$")
    return ip, tonumber(port)
end

-- Does anything listen there? A refused connection answers at once on a live host.
local function accepts(address)
    local ip, port = split(address)
    local sock = core.tcp()
    sock:settimeout(1)
    local ok = sock:connect(ip, port)
    sock:close()
    return ok ~= nil
end

-- An HTTP/1.1 answer read off a socket: status, headers (lower-case names), body; nil
-- when the connection broke. Reads exactly the answer (the connection may be reused).
local function read_answer(sock)
    local line = sock:receive("*l")
    local status = line and tonumber(line:match("^HTTP/1%.%d (%d%d%d)"))
    if not status then
        return nil
    end
    local headers = {}
    while true do
        line = sock:receive("*l")
        if line == nil then
            return nil
        end
        if line == "" then
            break
        end
        local name, value = line:match("^([^:]+):%s*(.-)%s*$")
        if name then
            headers[name:lower()] = value
        end
    end
    local length = tonumber(headers["content-length"] or "0") or 0
    local body = length > 0 and sock:receive(length) or ""
    if body == nil then
        return nil
    end
    return status, headers, body
end

-- One POST to epick on a connection of its own (a socket cannot outlive the request
-- that opened it), written and read here rather than through core.httpclient's applet.
local function post(ip, port, path, headers, body)
    local sock = core.tcp()
    sock:settimeout(30)
    if not sock:connect(ip, port) then
        sock:close()
        return nil
    end
    sock:send("POST " .. path .. " HTTP/1.1\r\nhost: epick\r\ncontent-type: application/json"
        .. "\r\ncontent-length: " .. #body .. "\r\n" .. headers .. "\r\n" .. body)
    local status, answer_headers, answer = read_answer(sock)
    sock:close()
    return status, answer_headers, answer
end

core.register_action("epick_route", { "http-req" }, function(txn)
    txn:set_var("txn.epick_started_us", now_us())
    local body = txn.sf:req_body() or ""
    local length = tonumber(txn.sf:req_hdr("content-length") or "") or #body
    if length > #body then
        return fail(txn, 413, "request body larger than HAProxy's buffer "
            .. "(tune.bufsize): epick cannot read it", "")
    end
    -- The client's headers (HAProxy has already refused any with a line break in them).
    local lines = { "x-epick-path: ", txn.sf:path(), "\r\nconnection: close\r\n" }
    for name, values in pairs(txn.http:req_get_headers()) do
        if not SKIP[name] then
            lines[#lines + 1] = name .. ": " .. values[0] .. "\r\n"
        end
    end
    local status, headers, answer = post(ROUTE_IP, ROUTE_PORT, ROUTE_PATH,
                                         table.concat(lines), body)
    local json = ((headers or {})["content-type"] or ""):find("json")
    if status == nil or (status >= 500 and not json) then
        -- epick is unreachable: the configured behaviour.
        if FAILURE_MODE == "open" then
            txn:set_var("txn.epick_open", true)
            return
        end
        return fail(txn, 503, "epick unreachable", "rejected-internal")
    end
    if status ~= 200 then
        local message = answer:match('"message": *"(.-)"}') or answer
        return fail(txn, status, "epick: " .. message,
                    headers["x-llm-d-request-dropped-reason"])
    end
    -- The header carries "primary,fallback,...", the decision id its own header.
    local chosen = headers["x-gateway-destination-endpoint"] or ""
    local decision = headers["x-epick-decision-id"] or ""
    local candidates = {}
    for address in chosen:gmatch("[^,]+") do
        candidates[#candidates + 1] = address
    end
    -- HAProxy cannot switch destinations after a refused connection: try the fallbacks
    -- here, before it connects (one extra connect per request while the primary is down).
    local endpoint = candidates[1]
    if #candidates > 1 and not accepts(endpoint) then
        for i = 2, #candidates do
            if accepts(candidates[i]) then
                endpoint = candidates[i]
                break
            end
        end
    end
    local ip, port = split(endpoint)
    txn:set_var("txn.epick_ip", ip)
    txn:set_var("txn.epick_port", port)
    txn:set_var("txn.epick_endpoint", endpoint)
    txn:set_var("txn.epick_decision", decision)
end, 0)

-- Reports waiting for the reporter task (filters cannot do I/O: they must not yield).
local pending = {}

-- The reporter: one task, one kept-alive connection to epick, every queued report in turn.
core.register_task(function()
    local sock
    while true do
        if #pending == 0 then
            core.msleep(5)
        else
            local batch = pending
            pending = {}
            for _, body in ipairs(batch) do
                for _ = 1, 2 do  -- a kept-alive connection epick closed: once more, anew
                    if sock == nil then
                        sock = core.tcp()
                        sock:settimeout(10)
                        if not sock:connect(REPORT_IP, REPORT_PORT) then
                            sock:close()
                            sock = nil
                            break  -- epick is down: this report is lost (decision expiry)
                        end
                    end
                    -- (return=minimal: a 204, no CompletionAck to write and read)
                    sock:send("POST " .. REPORT_PATH .. " HTTP/1.1\r\nhost: epick\r\n"
                        .. "prefer: return=minimal\r\n"
                        .. "content-type: application/json\r\ncontent-length: " .. #body
                        .. "\r\n\r\n" .. body)
                    if read_answer(sock) then
                        break
                    end
                    sock:close()
                    sock = nil
                end
            end
        end
    end
end)

local function report(txn, status, usage)
    local decision = txn:get_var("txn.epick_decision")
    if not decision or decision == "" then
        return
    end
    local parts = { '{"decisionId":', json_string(decision), ',"endpoint":',
                    json_string(txn:get_var("txn.epick_endpoint") or ""), ',"status":"',
                    status, '"' }
    if usage.prompt then
        parts[#parts + 1] = ',"promptTokens":' .. usage.prompt
    end
    if usage.completion then
        parts[#parts + 1] = ',"completionTokens":' .. usage.completion
    end
    if usage.ttft then
        parts[#parts + 1] = string.format(',"ttftSeconds":%.6f', usage.ttft)
    end
    parts[#parts + 1] = "}"
    pending[#pending + 1] = table.concat(parts)
end

-- Usage from a decoded-enough JSON text: the numbers after "prompt_tokens" and
-- "completion_tokens" inside its "usage" object (no JSON library in HAProxy's Lua).
local function read_usage(text, usage)
    local object = text:match('"usage"%s*:%s*(%b{})')
    if object then
        usage.prompt = object:match('"prompt_tokens"%s*:%s*(%d+)') or usage.prompt
        usage.completion = object:match('"completion_tokens"%s*:%s*(%d+)') or usage.completion
    end
end

-- The response filter (`filter lua.epick_usage` in the epick_endpoint backend): reads
-- the answer as it passes without holding it, then queues the report at its end.
local Usage = { id = "epick usage", flags = filter.FLT_CFG_FL_HTX }
Usage.__index = Usage

function Usage:new()
    return setmetatable({ usage = {}, tail = "", parts = {}, size = 0, done = false }, Usage)
end

function Usage:start_analyze(txn, chn)
    if chn:is_resp() then
        filter.register_data_filter(self, chn)
    end
end

function Usage:http_headers(txn, msg)
    if msg:is_resp() then
        local ctype = (msg:get_headers()["content-type"] or {})[0] or ""
        ctype = ctype:match("^%s*([^;%s]*)"):lower()
        self.sse = ctype == "text/event-stream"
        self.json = ctype == "application/json"
        self.status = tonumber(txn.sf:status()) or 0
    end
end

function Usage:http_payload(txn, msg)
    if not msg:is_resp() then
        return
    end
    local data = msg:body()
    if data == nil or #data == 0 then
        return
    end
    if self.sse then
        if self.usage.ttft == nil then
            local started = txn:get_var("txn.epick_started_us")
            self.usage.ttft = started and math.max(0, now_us() - started) / 1e6
        end
        local text = self.tail .. data
        local cut = text:match(".*()\n")
        if cut then
            if text:find('"usage"', 1, true) then
                for line in text:sub(1, cut):gmatch("data:([^\n]*)") do
                    read_usage(line, self.usage)
                end
            end
            self.tail = text:sub(cut + 1)
        else
            self.tail = text
        end
        if #self.tail > MAX_JSON then
            self.tail = ""
        end
    elseif self.json and self.parts then
        self.size = self.size + #data
        if self.size > MAX_JSON then
            self.parts = nil
        else
            self.parts[#self.parts + 1] = data
        end
    end
end

function Usage:http_end(txn, msg)
    if msg:is_resp() and not self.done then
        self.done = true
        if self.json and self.parts then
            read_usage(table.concat(self.parts), self.usage)
        end
        local status = self.status or 0
        report(txn, (status >= 400 or status == 0) and "ERROR" or "OK", self.usage)
    end
end

-- The stream ends without the answer's end (the client left, the replica broke off).
function Usage:end_analyze(txn, chn)
    if chn:is_resp() and not self.done then
        self.done = true
        report(txn, "CANCELLED", self.usage)
    end
end

core.register_filter("epick_usage", Usage, function(flt, args)
    return flt
end)
