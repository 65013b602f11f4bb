//! The fake refuses a `SandboxCreate` whose sandbox name travels in the wrong field: number 29,
//! where our proto once put it, is `bool verbose` in Modal's `api.proto` (the name is 30). The
//! fake is built from the same file as our client, so without this a client that regressed to
//! 29 would still pass every contract test. Needs no Docker: the refusal happens while decoding.
// See: issue 32

use fake_modal::{FakeConfig, FakeModal, pb};
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::Endpoint;

/// `Sandbox` as a client that puts the name in field 29 encodes it.
#[derive(Clone, PartialEq, prost::Message)]
struct SandboxNamedAt29 {
    #[prost(string, tag = "3")]
    image_id: String,
    #[prost(string, optional, tag = "29")]
    name: Option<String>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct CreateNamedAt29 {
    #[prost(string, tag = "1")]
    app_id: String,
    #[prost(message, optional, tag = "2")]
    definition: Option<SandboxNamedAt29>,
}

async fn call<Q, R>(
    fake: &FakeModal,
    method: &str,
    message: Q,
    token: Option<&str>,
) -> Result<R, tonic::Status>
where
    Q: prost::Message + Send + Sync + 'static,
    R: prost::Message + Default + Send + Sync + 'static,
{
    let channel = Endpoint::from_shared(fake.url())
        .unwrap_or_else(|e| panic!("endpoint: {e}"))
        .connect()
        .await
        .unwrap_or_else(|e| panic!("connect: {e}"));
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap_or_else(|e| panic!("ready: {e}"));
    let mut request = tonic::Request::new(message);
    let config = fake.config();
    for (key, value) in [
        ("x-modal-client-type", "9"),
        ("x-modal-client-version", "1.0.0"),
        ("x-modal-libmodal-version", "modal-go/0.7.4"),
        ("x-modal-token-id", config.token_id.as_str()),
        ("x-modal-token-secret", config.token_secret.as_str()),
    ]
    .into_iter()
    .chain(token.map(|t| ("x-modal-auth-token", t)))
    {
        request
            .metadata_mut()
            .insert(key, value.parse().unwrap_or_else(|e| panic!("{key}: {e}")));
    }
    let path = PathAndQuery::try_from(format!("/modal.client.ModalClient/{method}"))
        .unwrap_or_else(|e| panic!("path: {e}"));
    grpc.unary(request, path, tonic_prost::ProstCodec::default())
        .await
        .map(tonic::Response::into_inner)
}

#[tokio::test]
async fn issue_32_sandbox_create_with_the_name_in_field_29_is_refused() {
    let fake = FakeModal::start(FakeConfig::default())
        .await
        .unwrap_or_else(|e| panic!("start the fake: {e}"));
    let token: pb::AuthTokenGetResponse =
        call(&fake, "AuthTokenGet", pb::AuthTokenGetRequest {}, None)
            .await
            .unwrap_or_else(|e| panic!("AuthTokenGet: {e}"));
    let token = token.token;

    let wrong = CreateNamedAt29 {
        app_id: "ap-nowhere".to_owned(),
        definition: Some(SandboxNamedAt29 {
            image_id: "im-x".to_owned(),
            name: Some("my-computer".to_owned()),
        }),
    };
    let refused = call::<_, pb::SandboxCreateResponse>(&fake, "SandboxCreate", wrong, Some(&token))
        .await
        .err()
        .unwrap_or_else(|| panic!("a name in field 29 must be refused"));
    assert!(
        refused.message().contains("decode"),
        "refused while decoding, not later: {refused:?}"
    );
    assert!(
        !fake.log().iter().any(|c| c.method == "SandboxCreate"),
        "the refused request never reaches the handler"
    );

    // The same request with the name in field 30 decodes and reaches the handler, which then
    // refuses it for its unknown app: the difference above is the field number alone.
    let right = pb::SandboxCreateRequest {
        app_id: "ap-nowhere".to_owned(),
        definition: Some(pb::Sandbox {
            image_id: "im-x".to_owned(),
            name: Some("my-computer".to_owned()),
            ..Default::default()
        }),
        ..Default::default()
    };
    let answer = call::<_, pb::SandboxCreateResponse>(&fake, "SandboxCreate", right, Some(&token))
        .await
        .err()
        .unwrap_or_else(|| panic!("the app does not exist"));
    assert_eq!(answer.code(), tonic::Code::NotFound, "{answer:?}");
    assert!(fake.log().iter().any(|c| c.method == "SandboxCreate"));
}
