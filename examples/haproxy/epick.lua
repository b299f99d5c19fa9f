-- Lua for haproxy.cfg: ask epick where each request goes (POST /v1/route), then let the
-- epick_endpoint backend send it there; report the answer's status to /v1/completion.
-- Needs HAProxy >= 2.5 (core.httpclient); Debian 12 ships 2.6.

local ROUTE_URL = os.getenv("EPICK_ROUTE_URL") or "http://127.0.0.1:9005/v1/route"
local COMPLETION_URL = os.getenv("EPICK_COMPLETION_URL")
    or "http://127.0.0.1:9005/v1/completion"
local FAILURE_MODE = os.getenv("EPICK_FAILURE_MODE") or "closed"

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

local function first_header(headers, name)
    local values = headers and headers[name]
    if type(values) == "table" then
        return values[0] or values[1]
    end
    return values
end

core.register_action("epick_route", { "http-req" }, function(txn)
    local body = txn.sf:req_body() or ""
    local length = tonumber(txn.sf:req_hdr("content-length") or "") or #body
    if length > #body then
        return fail(txn, 413, "request body larger than HAProxy's buffer "
            .. "(tune.bufsize): epick cannot read it", "")
    end
    local headers = { ["content-type"] = { "application/json" },
                      ["x-epick-path"] = { txn.sf:path() } }
    for name, values in pairs(txn.http:req_get_headers()) do
        if not SKIP[name] then
            headers[name] = { values[0] }
        end
    end
    local ok, res = pcall(function()
        return core.httpclient():post({ url = ROUTE_URL, headers = headers, body = body })
    end)
    -- epick's own answers are JSON; httpclient's (epick down: 503 "No server is
    -- available") are not.
    local json = (first_header(res and res.headers, "content-type") or ""):find("json")
    if not ok or res == nil or not res.status or (res.status >= 500 and not json) then
        -- epick is unreachable: the configured behaviour.
        if FAILURE_MODE == "open" then
            txn:set_var("txn.epick_open", true)
            return
        end
        return fail(txn, 503, "epick unreachable", "rejected-internal")
    end
    if res.status ~= 200 then
        local message = (res.body or ""):match('"message": *"(.-)"}') or res.body or ""
        return fail(txn, res.status, "epick: " .. message,
                    first_header(res.headers, "x-llm-d-request-dropped-reason"))
    end
    -- The header carries "primary,fallback,...", the decision id its own header.
    local chosen = first_header(res.headers, "x-gateway-destination-endpoint") or ""
    local decision = first_header(res.headers, "x-epick-decision-id") or ""
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

-- At the answer's headers (HAProxy's Lua sees no end of a streamed body): report the
-- status. A stream's in-flight count is released at its first byte; epick's decision
-- expiry ([server] decision_ttl_s) covers anything never reported.
core.register_action("epick_report", { "http-res" }, function(txn)
    local decision = txn:get_var("txn.epick_decision")
    if not decision or decision == "" then
        return
    end
    local status = tonumber(txn.sf:status()) or 0
    local body = '{"decisionId":' .. json_string(decision) .. ',"endpoint":'
        .. json_string(txn:get_var("txn.epick_endpoint") or "") .. ',"status":"'
        .. ((status >= 400 or status == 0) and "ERROR" or "OK") .. '"}'
    pcall(function()
        core.httpclient():post({ url = COMPLETION_URL, body = body,
            headers = { ["content-type"] = { "application/json" } } })
    end)
end, 0)
