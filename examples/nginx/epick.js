// njs for nginx.conf: ask epick where the request goes, hand it to @endpoint, read usage
// and TTFT from the answer as it passes, and write the completion report.
// Needs njs >= 0.5.3 (js_var, js_body_filter); Debian 12 ships 0.7.9.

const TYPES = { 400: 'invalid_request_error', 413: 'invalid_request_error',
                429: 'rate_limit_exceeded', 503: 'service_unavailable' };
// A JSON answer larger than this is passed through unread (no usage reported).
const MAX_JSON = 4 << 20;

function fail(r, status, message, reason) {
    r.headersOut['Content-Type'] = 'application/json';
    if (reason) {
        r.headersOut['x-llm-d-request-dropped-reason'] = reason;
    }
    r.return(status, JSON.stringify({ error: { message: message,
        type: TYPES[status] || 'server_error', code: status } }));
}

// js_content: POST the request (its headers and body) to /v1/route through the
// /_epick/route location (kept-alive connections to epick), then proxy to the endpoint.
async function route(r) {
    const reply = await r.subrequest('/_epick/route',
                                     { method: 'POST', body: r.requestText || '' });
    const text = reply.responseText || '';
    const json = (reply.headersOut['Content-Type'] || '').indexOf('json') >= 0;
    if (reply.status >= 500 && !json) {
        // NGINX's own 502/504: epick is unreachable. The configured behaviour.
        if (r.variables.epick_failure_mode === 'open') {
            r.internalRedirect('@roundrobin');
            return;
        }
        fail(r, 503, 'epick unreachable: HTTP ' + reply.status, 'rejected-internal');
        return;
    }
    if (reply.status !== 200) {
        let message = text;
        try { message = JSON.parse(text).message; } catch (e) { /* not JSON: as is */ }
        fail(r, reply.status, 'epick: ' + message,
             reply.headersOut['x-llm-d-request-dropped-reason']);
        return;
    }
    const choice = JSON.parse(text);
    r.variables.epick_endpoint = choice.endpoint;
    r.variables.epick_fallback1 = choice.fallbacks[0] || '';
    r.variables.epick_fallback2 = choice.fallbacks[1] || '';
    r.variables.epick_decision = choice.decisionId;
    r.internalRedirect('@endpoint');
}

// js_body_filter: every chunk passes on at once; on the way, the first SSE chunk's time
// is the TTFT ($request_time: since the request's first byte, ms resolution) and usage is
// read from any `data:` event that carries it (the last wins), or from a JSON answer.
let sse = null;
let tail = '';
let parts = [];
let size = 0;

function tokens(usage, r) {
    if (usage && typeof usage === 'object') {
        if (Number.isInteger(usage.prompt_tokens) && usage.prompt_tokens >= 0) {
            r.variables.epick_prompt_tokens = String(usage.prompt_tokens);
        }
        if (Number.isInteger(usage.completion_tokens) && usage.completion_tokens >= 0) {
            r.variables.epick_completion_tokens = String(usage.completion_tokens);
        }
    }
}

function usage(r, data, flags) {
    r.sendBuffer(data, flags);
    if (sse === null) {
        const type = (r.headersOut['Content-Type'] || '').split(';')[0].trim().toLowerCase();
        sse = type === 'text/event-stream' ? true : type === 'application/json' ? false : 0;
    }
    if (sse === true) {
        if (data.length && !r.variables.epick_ttft) {
            r.variables.epick_ttft = r.variables.request_time;
        }
        const text = tail + data;
        const cut = text.lastIndexOf('\n');
        tail = cut < 0 ? text : text.slice(cut + 1);
        if (tail.length > MAX_JSON) {
            tail = '';
        }
        if (cut >= 0 && text.indexOf('"usage"') >= 0) {
            const lines = text.slice(0, cut).split('\n');
            for (let i = 0; i < lines.length; i++) {
                const line = lines[i];
                if (line.startsWith('data:') && line.indexOf('"usage"') >= 0) {
                    try { tokens(JSON.parse(line.slice(5)).usage, r); } catch (e) { /* not JSON */ }
                }
            }
        }
    } else if (sse === false && parts !== null) {
        size += data.length;
        if (size > MAX_JSON) {
            parts = null;
        } else {
            parts.push(data);
        }
        if (flags.last && parts !== null) {
            try { tokens(JSON.parse(parts.join('')).usage, r); } catch (e) { /* not JSON */ }
        }
    }
}

// js_set $epick_report, read by /_epick/report (post_action, after the response is sent):
// the CompletionReport. Best effort: epick's decision expiry ([server] decision_ttl_s)
// forgets a decision that is never reported.
function report_body(r) {
    const v = r.variables;
    const status = Number(v.status);
    const doc = { decisionId: v.epick_decision, endpoint: v.epick_served || v.epick_endpoint,
                  status: status >= 400 || status === 0 ? 'ERROR' : 'OK' };
    if (v.epick_prompt_tokens) {
        doc.promptTokens = Number(v.epick_prompt_tokens);
    }
    if (v.epick_completion_tokens) {
        doc.completionTokens = Number(v.epick_completion_tokens);
    }
    if (v.epick_ttft) {
        doc.ttftSeconds = Number(v.epick_ttft);
    }
    return JSON.stringify(doc);
}

export default { route, usage, report_body };
