// njs for nginx.conf: ask epick where the request goes, then hand it to @endpoint.
// Needs njs >= 0.5.3 (ngx.fetch, js_var); Debian 12 ships 0.7.9.

const SKIP = { host: 1, 'content-length': 1, 'content-type': 1, connection: 1,
               'transfer-encoding': 1, 'keep-alive': 1, expect: 1 };
const TYPES = { 400: 'invalid_request_error', 413: 'invalid_request_error',
                429: 'rate_limit_exceeded', 503: 'service_unavailable' };

function fail(r, status, message, reason) {
    r.headersOut['Content-Type'] = 'application/json';
    if (reason) {
        r.headersOut['x-llm-d-request-dropped-reason'] = reason;
    }
    r.return(status, JSON.stringify({ error: { message: message,
        type: TYPES[status] || 'server_error', code: status } }));
}

async function route(r) {
    const headers = { 'Content-Type': 'application/json', 'x-epick-path': r.uri };
    for (const name in r.headersIn) {
        if (!SKIP[name.toLowerCase()]) {
            headers[name] = r.headersIn[name];
        }
    }
    let reply;
    try {
        reply = await ngx.fetch(r.variables.epick_route_url, {
            method: 'POST', headers: headers, body: r.requestText || '' });
    } catch (e) {
        // epick is unreachable: the configured behaviour.
        if (r.variables.epick_failure_mode === 'open') {
            r.internalRedirect('@roundrobin');
            return;
        }
        fail(r, 503, 'epick unreachable: ' + e, 'rejected-internal');
        return;
    }
    const text = await reply.text();
    if (reply.status !== 200) {
        let message = text;
        try { message = JSON.parse(text).message; } catch (e) { /* not JSON: as is */ }
        fail(r, reply.status, 'epick: ' + message,
             reply.headers.get('x-llm-d-request-dropped-reason'));
        return;
    }
    const choice = JSON.parse(text);
    r.variables.epick_endpoint = choice.endpoint;
    r.variables.epick_fallback1 = choice.fallbacks[0] || '';
    r.variables.epick_fallback2 = choice.fallbacks[1] || '';
    r.variables.epick_decision = choice.decisionId;
    r.internalRedirect('@endpoint');
}

// post_action: the response is sent; report how it ended. Best effort: epick's decision
// expiry ([server] decision_ttl_s) forgets a decision that is never reported.
async function report(r) {
    const status = Number(r.variables.status);
    const body = JSON.stringify({ decisionId: r.variables.epick_decision,
        endpoint: r.variables.epick_served || r.variables.epick_endpoint,
        status: status >= 400 || status === 0 ? 'ERROR' : 'OK' });
    try {
        await ngx.fetch(r.variables.epick_completion_url, {
            method: 'POST', headers: { 'Content-Type': 'application/json' }, body: body });
    } catch (e) {
        ngx.log(ngx.WARN, 'epick: completion not reported: ' + e);
    }
    r.return(204);
}

export default { route, report };
