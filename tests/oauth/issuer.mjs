// A local OAuth 2.1 authorization server for the black-box OAuth tests (oidc-provider).
//
//   node tests/oauth/issuer.mjs [PORT] [--alg ALG] [--discovery both|oidc] [--kid-prefix P] [--forge-iss URL]
//
// Listens on 127.0.0.1:PORT (0 or none = a free port), prints ONE JSON line to stdout once it
// answers, {"issuer": "http://127.0.0.1:PORT", "jwks_uri", "alg", "kid_prefix"}, and runs until
// SIGTERM/SIGINT or EOF on stdin (so started with stdin </dev/null it stops at once). Logs go to
// stderr. Everything is in memory: keys are made at startup, nothing is written to disk.
//
// What it issues:
// * Authorization code + PKCE (S256, required) for the public clients below, redirect URI
//   http://127.0.0.1/callback (any port: loopback redirect of a native app). Nothing needs to
//   serve it: the client reads `code` from the Location of the last redirect.
// * Resource indicators (RFC 8707): `resource=<any absolute http(s) URL>` in the authorization
//   and token requests gives a JWT access token (header typ "at+jwt", signed with --alg, default
//   RS256; the JWKS holds an RSA, a P-256 and an Ed25519 key) whose `aud` is that URL and whose
//   `scope` holds the requested resource scopes (`mcp:tools`, `mcp:read`) as one space
//   separated string. `openid` and `offline_access` are the provider's own scopes.
// * Login: no password. The authorization request's `login_hint` logs in as that name at once
//   (the account id and so `sub`); without it, GET /interaction/<uid> shows a form with a
//   `login` field to POST back. Consent is given automatically for everything requested.
//   Every token also carries `email: "<sub>@example.test"` (for --oauth-principal-claim tests).
// * Clients (all public, token_endpoint_auth_method none):
//     kilntainers-test                  normal tokens, valid for an hour
//     kilntainers-test-expired          signed tokens whose exp is 5 minutes in the past
//     kilntainers-test-not-yet-valid    signed tokens with nbf 5 minutes in the future
//     kilntainers-test-within-leeway    signed tokens whose exp is 5 seconds in the past
//     kilntainers-test-scp              the scopes as an `scp` array instead of `scope`
//     kilntainers-test-other-iss        `iss` is the issuer with `/other` appended
//     kilntainers-test-no-exp           no `exp` claim at all
//     kilntainers-test-string-nbf       `nbf` 5 minutes in the future, written as a JSON string
//                                       (CVE-2026-25537: jsonwebtoken < 10.3 skipped such a claim)
//     kilntainers-test-string-exp       `exp` 5 minutes in the past, written as a JSON string
//   plus open dynamic client registration at /reg (for SDK clients that register themselves).
// * Discovery at /.well-known/openid-configuration and (unless --discovery oidc) at
//   /.well-known/oauth-authorization-server; JWKS at /jwks.
// * Signing keys have kids `<prefix>-rsa-1`, `<prefix>-p256-1`, `<prefix>-ed25519-1` with a random
//   prefix per instance, or --kid-prefix P. With --forge-iss URL every token claims `iss: URL`:
//   with another instance's URL and kid prefix, a forgery of its tokens signed with other keys.
// * Test-only routes /-/rotate-keys and /-/rsa-public-key.pem, described where they are served.
import { once } from 'node:events';
import * as crypto from 'node:crypto';
import * as http from 'node:http';

import Provider, { errors } from 'oidc-provider';

const args = process.argv.slice(2);
let port = 0;
let alg = 'RS256';
let discovery = 'both';
let forgeIss;
let kidPrefix = crypto.randomBytes(3).toString('hex');
for (let i = 0; i < args.length; i += 1) {
  const arg = args[i];
  if (arg === '--alg') {
    alg = args[(i += 1)];
  } else if (arg === '--discovery') {
    discovery = args[(i += 1)];
  } else if (arg === '--forge-iss') {
    forgeIss = args[(i += 1)];
  } else if (arg === '--kid-prefix') {
    kidPrefix = args[(i += 1)];
  } else if (/^\d+$/.test(arg)) {
    port = Number(arg);
  } else {
    process.stderr.write(`issuer.mjs: unknown argument ${arg}\n`);
    process.exit(2);
  }
}
const ALGS = ['RS256', 'PS256', 'ES256', 'EdDSA', 'Ed25519'];
if (!ALGS.includes(alg) || !['both', 'oidc'].includes(discovery)) {
  process.stderr.write(`issuer.mjs: --alg must be one of ${ALGS.join(', ')}; --discovery both or oidc\n`);
  process.exit(2);
}

const REDIRECT_URI = 'http://127.0.0.1/callback';
const RESOURCE_SCOPES = 'mcp:tools mcp:read';
// What each client's tokens get (see the header comment): seconds added to now for iat/exp/nbf.
const CLIENTS = {
  'kilntainers-test': {},
  'kilntainers-test-expired': { iat: -900, exp: -300 },
  'kilntainers-test-not-yet-valid': { nbf: 300 },
  'kilntainers-test-within-leeway': { iat: -3605, exp: -5 },
  'kilntainers-test-scp': { scp: true },
  'kilntainers-test-other-iss': { iss: '/other' },
  'kilntainers-test-no-exp': { noExp: true },
  'kilntainers-test-string-nbf': { nbf: 300, asString: true },
  'kilntainers-test-string-exp': { iat: -900, exp: -300, asString: true },
};

// Key generation `generation` has the kids <prefix>-rsa-N, <prefix>-p256-N and <prefix>-ed25519-N.
function signingKeys(generation) {
  const pairs = {
    rsa: crypto.generateKeyPairSync('rsa', { modulusLength: 2048 }),
    p256: crypto.generateKeyPairSync('ec', { namedCurve: 'P-256' }),
    ed25519: crypto.generateKeyPairSync('ed25519'),
  };
  return {
    jwks: Object.entries(pairs).map(([name, { privateKey }]) => (
      { ...privateKey.export({ format: 'jwk' }), kid: `${kidPrefix}-${name}-${generation}`, use: 'sig' })),
    rsaPublicPem: pairs.rsa.publicKey.export({ format: 'pem', type: 'spki' }),
  };
}

function resourceServerInfo(_ctx, resource) {
  let url;
  try {
    url = new URL(resource);
  } catch {
    throw new errors.InvalidTarget();
  }
  if (!['http:', 'https:'].includes(url.protocol) || url.hash) {
    throw new errors.InvalidTarget();
  }
  return {
    scope: RESOURCE_SCOPES,
    audience: resource,
    accessTokenFormat: 'jwt',
    accessTokenTTL: 3600,
    jwt: { sign: { alg } },
  };
}

// The one-step interaction: log in as `login_hint` (or the posted `login`), consent to all.
async function interaction(ctx, next) {
  const match = /^\/interaction\/([^/]+)$/.exec(ctx.path);
  if (!match) return next();
  ctx.set('cache-control', 'no-store');
  const details = await provider.interactionDetails(ctx.req, ctx.res);
  const { prompt, params, session } = details;
  let result;
  if (prompt.name === 'login') {
    let login = params.login_hint;
    if (ctx.method === 'POST') {
      const body = new URLSearchParams(await readBody(ctx.req));
      login = body.get('login');
    }
    if (!login) {
      ctx.type = 'html';
      ctx.body = `<!doctype html><title>Sign in</title><form method="post" action="${ctx.path}">`
        + '<input name="login" autofocus><button>Sign in</button></form>';
      return undefined;
    }
    result = { login: { accountId: login } };
  } else if (prompt.name === 'consent') {
    const grant = details.grantId
      ? await provider.Grant.find(details.grantId)
      : new provider.Grant({ accountId: session.accountId, clientId: params.client_id });
    const missing = prompt.details;
    if (missing.missingOIDCScope) grant.addOIDCScope(missing.missingOIDCScope.join(' '));
    if (missing.missingOIDCClaims) grant.addOIDCClaims(missing.missingOIDCClaims);
    for (const [indicator, scopes] of Object.entries(missing.missingResourceScopes || {})) {
      grant.addResourceScope(indicator, scopes.join(' '));
    }
    result = { consent: { grantId: await grant.save() } };
  } else {
    ctx.throw(501, `prompt ${prompt.name} not implemented`);
  }
  const redirectTo = await provider.interactionResult(ctx.req, ctx.res, result, { mergeWithLastSubmission: true });
  ctx.status = 303;
  ctx.redirect(redirectTo);
  return undefined;
}

async function readBody(req) {
  const chunks = [];
  for await (const chunk of req) chunks.push(chunk);
  return Buffer.concat(chunks).toString();
}

function makeProvider(issuer, keys) {
  const p = new Provider(issuer, {
    clients: Object.keys(CLIENTS).map((clientId) => ({
      client_id: clientId,
      application_type: 'native',
      token_endpoint_auth_method: 'none',
      grant_types: ['authorization_code', 'refresh_token'],
      response_types: ['code'],
      redirect_uris: [REDIRECT_URI],
    })),
    jwks: { keys: keys.jwks },
    cookies: { keys: [crypto.randomBytes(32).toString('base64url')] },
    pkce: { required: () => true },
    scopes: ['openid', 'offline_access', ...RESOURCE_SCOPES.split(' ')],
    claims: { openid: ['sub'], email: ['email'] },
    findAccount: (_ctx, accountId) => ({
      accountId,
      claims: () => ({ sub: accountId, email: `${accountId}@example.test` }),
    }),
    interactions: { url: (_ctx, { uid }) => `/interaction/${uid}` },
    features: {
      devInteractions: { enabled: false },
      registration: { enabled: true },
      resourceIndicators: {
        enabled: true,
        defaultResource: (_ctx, _client, oneOf) => oneOf,
        useGrantedResource: () => true,
        getResourceServerInfo: resourceServerInfo,
      },
    },
    extraTokenClaims: (_ctx, token) => (token.accountId ? { email: `${token.accountId}@example.test` } : undefined),
    formats: {
      customizers: {
        jwt(_ctx, token, jwt) {
          const shift = CLIENTS[token.clientId] || {};
          const now = Math.floor(Date.now() / 1000);
          if (shift.iat !== undefined) jwt.payload.iat = now + shift.iat;
          if (shift.exp !== undefined) jwt.payload.exp = now + shift.exp;
          if (shift.nbf !== undefined) jwt.payload.nbf = now + shift.nbf;
          if (shift.noExp) delete jwt.payload.exp;
          if (shift.asString) {
            for (const claim of ['nbf', 'exp']) {
              if (shift[claim] !== undefined) jwt.payload[claim] = String(jwt.payload[claim]);
            }
          }
          if (shift.scp) {
            jwt.payload.scp = (jwt.payload.scope || '').split(' ').filter(Boolean);
            delete jwt.payload.scope;
          }
          if (shift.iss) jwt.payload.iss = `${issuer}${shift.iss}`;
          if (forgeIss) jwt.payload.iss = forgeIss;
        },
      },
    },
    clientDefaults: { id_token_signed_response_alg: alg },
    ttl: {
      AccessToken: 3600, AuthorizationCode: 60, Grant: 3600, IdToken: 3600, Interaction: 600, RefreshToken: 3600, Session: 3600,
    },
  });
  if (discovery === 'oidc') {
    p.use(async (ctx, next) => {
      if (ctx.path === '/.well-known/oauth-authorization-server') ctx.throw(404);
      return next();
    });
  }
  p.use(interaction);
  p.on('server_error', (_ctx, err) => process.stderr.write(`issuer.mjs: server_error ${err.stack}\n`));
  return p;
}

const server = http.createServer();
server.listen(port, '127.0.0.1');
await once(server, 'listening');
const issuer = `http://127.0.0.1:${server.address().port}`;

let generation = 1;
let keys = signingKeys(generation);
let provider = makeProvider(issuer, keys);
let handler = provider.callback();
// Test-only routes beside the provider's:
//   POST /-/rotate-keys  new signing keys with new kids (the old ones are gone from the JWKS):
//                        answers {"kids": [...]}; sessions and grants are forgotten with them.
//   GET /-/rsa-public-key.pem  the RSA signing key's public half (for key-confusion tokens).
server.on('request', (req, res) => {
  if (req.method === 'POST' && req.url === '/-/rotate-keys') {
    generation += 1;
    keys = signingKeys(generation);
    provider = makeProvider(issuer, keys);
    handler = provider.callback();
    res.setHeader('content-type', 'application/json');
    res.end(JSON.stringify({ kids: keys.jwks.map((k) => k.kid) }));
  } else if (req.method === 'GET' && req.url === '/-/rsa-public-key.pem') {
    res.setHeader('content-type', 'application/x-pem-file');
    res.end(keys.rsaPublicPem);
  } else {
    handler(req, res);
  }
});

const stop = () => {
  server.close();
  server.closeAllConnections();
  process.exit(0);
};
process.on('SIGTERM', stop);
process.on('SIGINT', stop);
process.stdin.on('end', stop);
process.stdin.resume();

process.stdout.write(`${JSON.stringify({ issuer, jwks_uri: `${issuer}/jwks`, alg, kid_prefix: kidPrefix })}\n`);
