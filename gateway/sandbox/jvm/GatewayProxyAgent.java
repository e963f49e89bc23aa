/*
 * sandbox-gateway's JVM agent: makes every Java HTTP client in the sandbox use the gateway
 * with no code and no secret on the command line. Loaded with
 * JAVA_TOOL_OPTIONS=-javaagent:/etc/sandbox-gateway/jvm-proxy-agent.jar (what
 * `sandbox-gateway env` prints); it reads HTTPS_PROXY, NO_PROXY and SSL_CERT_FILE, which
 * `env` also prints.
 *
 * Why an agent: the JDK has no setting that sends proxy credentials. HttpURLConnection
 * needs a default Authenticator (and Basic re-enabled for tunnels), java.net.http's
 * HttpClient one of its own on every builder (and with it drops the request's own
 * Authorization header), OkHttp and Apache clients their own. So the agent runs a relay on
 * 127.0.0.1 that adds Proxy-Authorization (from HTTPS_PROXY's user:token) to the first
 * request head of each connection (a CONNECT, or a plain-HTTP proxy request) and then
 * copies bytes both ways to the gateway, and points the proxy system properties at it:
 * every client that follows the JDK's proxy settings sends through it, without an
 * authenticator. The gateway keeps a connection's identity for its later requests.
 * Trust: a PKCS12 trust store written from SSL_CERT_FILE (the system bundle with the
 * gateway CA), set as javax.net.ssl.trustStore, which the JDK's default SSLContext and
 * clients that build their own from the JDK's trust manager both read. Properties that are
 * already set (-D on the command line) are left as they are.
 *
 * Build: make jvm-agent (javac --release 11; the jar is committed, package data).
 */
package io.sandboxgateway;

import java.io.BufferedInputStream;
import java.io.ByteArrayInputStream;
import java.io.ByteArrayOutputStream;
import java.io.IOException;
import java.io.InputStream;
import java.io.OutputStream;
import java.lang.instrument.Instrumentation;
import java.net.InetAddress;
import java.net.InetSocketAddress;
import java.net.ServerSocket;
import java.net.Socket;
import java.net.URI;
import java.net.URLDecoder;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.StandardCopyOption;
import java.security.KeyStore;
import java.security.MessageDigest;
import java.security.cert.Certificate;
import java.security.cert.CertificateFactory;
import java.util.Base64;

public final class GatewayProxyAgent {
    private static final int MAX_HEAD = 64 * 1024;
    private static final int IDLE_MS = 10 * 60 * 1000;

    private GatewayProxyAgent() {}

    public static void premain(String args, Instrumentation inst) throws Exception {
        String proxy = env("HTTPS_PROXY", "https_proxy");
        if (proxy == null) {
            proxy = env("HTTP_PROXY", "http_proxy");
        }
        if (proxy != null) {
            useProxy(URI.create(proxy));
        }
        String bundle = env("SSL_CERT_FILE", "ssl_cert_file");
        if (bundle != null && System.getProperty("javax.net.ssl.trustStore") == null) {
            Path store = trustStore(Path.of(bundle));
            System.setProperty("javax.net.ssl.trustStore", store.toString());
            System.setProperty("javax.net.ssl.trustStoreType", "PKCS12");
            System.setProperty("javax.net.ssl.trustStorePassword", "changeit");
        }
    }

    private static void useProxy(URI uri) throws IOException {
        String host = uri.getHost();
        int port = uri.getPort() == -1 ? 80 : uri.getPort();
        String info = uri.getRawUserInfo();
        String target = host;
        int targetPort = port;
        if (info != null && info.contains(":")) {
            String user = URLDecoder.decode(info.substring(0, info.indexOf(':')), StandardCharsets.UTF_8);
            String token = URLDecoder.decode(info.substring(info.indexOf(':') + 1), StandardCharsets.UTF_8);
            String basic = Base64.getEncoder().encodeToString(
                (user + ":" + token).getBytes(StandardCharsets.UTF_8));
            ServerSocket server = new ServerSocket(0, 128, InetAddress.getLoopbackAddress());
            Thread acceptor = new Thread(() -> accept(server, new InetSocketAddress(host, port),
                ("Proxy-Authorization: Basic " + basic + "\r\n").getBytes(StandardCharsets.US_ASCII)),
                "sandbox-gateway-relay");
            acceptor.setDaemon(true);
            acceptor.start();
            target = "127.0.0.1";
            targetPort = server.getLocalPort();
        }
        for (String scheme : new String[] {"https", "http"}) {
            setDefault(scheme + ".proxyHost", target);
            setDefault(scheme + ".proxyPort", String.valueOf(targetPort));
        }
        String noProxy = env("NO_PROXY", "no_proxy");
        if (noProxy != null) {
            StringBuilder hosts = new StringBuilder();
            for (String item : noProxy.split(",")) {
                String name = item.trim();
                if (name.startsWith(".")) {
                    name = "*" + name;
                }
                if (!name.isEmpty()) {
                    hosts.append(hosts.length() == 0 ? "" : "|").append(name);
                }
            }
            setDefault("http.nonProxyHosts", hosts.toString());
        }
    }

    private static void accept(ServerSocket server, InetSocketAddress gateway, byte[] header) {
        while (true) {
            try {
                Socket client = server.accept();
                Thread relay = new Thread(() -> relay(client, gateway, header), "sandbox-gateway-relay-conn");
                relay.setDaemon(true);
                relay.start();
            } catch (IOException e) {
                return;
            }
        }
    }

    /** One client connection: its first head with the credentials, then bytes both ways. */
    private static void relay(Socket client, InetSocketAddress gateway, byte[] header) {
        try (client; Socket upstream = new Socket()) {
            client.setSoTimeout(IDLE_MS);
            InputStream in = new BufferedInputStream(client.getInputStream());
            ByteArrayOutputStream head = new ByteArrayOutputStream();
            while (true) {
                int b = in.read();
                if (b < 0 || head.size() >= MAX_HEAD) {
                    return;
                }
                head.write(b);
                if (b == '\n' && endsWithBlankLine(head)) {
                    break;
                }
            }
            byte[] bytes = head.toByteArray();
            int firstLine = indexOf(bytes, (byte) '\n') + 1;
            upstream.connect(gateway, 30_000);
            upstream.setSoTimeout(IDLE_MS);
            OutputStream out = upstream.getOutputStream();
            out.write(bytes, 0, firstLine);
            if (!hasProxyAuthorization(bytes)) {
                out.write(header);
            }
            out.write(bytes, firstLine, bytes.length - firstLine);
            out.flush();
            InputStream fromGateway = upstream.getInputStream();
            Thread back = new Thread(() -> copy(fromGateway, upstream, client),
                                     "sandbox-gateway-relay-back");
            back.setDaemon(true);
            back.start();
            copy(in, client, upstream);
            back.join(IDLE_MS);
        } catch (IOException | InterruptedException e) {
            // the connection ends; the client sees its socket close
        }
    }

    private static boolean endsWithBlankLine(ByteArrayOutputStream head) {
        byte[] b = head.toByteArray();
        int n = b.length;
        return (n >= 2 && b[n - 1] == '\n' && b[n - 2] == '\n')
            || (n >= 4 && b[n - 1] == '\n' && b[n - 2] == '\r' && b[n - 3] == '\n' && b[n - 4] == '\r');
    }

    private static boolean hasProxyAuthorization(byte[] head) {
        String text = new String(head, StandardCharsets.ISO_8859_1).toLowerCase(java.util.Locale.ROOT);
        return text.contains("\nproxy-authorization:");
    }

    private static int indexOf(byte[] bytes, byte value) {
        for (int i = 0; i < bytes.length; i++) {
            if (bytes[i] == value) {
                return i;
            }
        }
        return bytes.length - 1;
    }

    private static void copy(InputStream in, Socket from, Socket to) {
        byte[] buffer = new byte[16384];
        try {
            OutputStream out = to.getOutputStream();
            int n;
            while ((n = in.read(buffer)) >= 0) {
                out.write(buffer, 0, n);
                out.flush();
            }
            to.shutdownOutput();
        } catch (IOException e) {
            try {
                to.close();
                from.close();
            } catch (IOException ignored) {
                // closing anyway
            }
        }
    }

    /** The bundle as a PKCS12 trust store in the temp directory (one per bundle content). */
    private static Path trustStore(Path bundle) throws Exception {
        byte[] pem = Files.readAllBytes(bundle);
        byte[] digest = MessageDigest.getInstance("SHA-256").digest(pem);
        StringBuilder hex = new StringBuilder();
        for (int i = 0; i < 8; i++) {
            hex.append(String.format("%02x", digest[i]));
        }
        Path tmp = Path.of(System.getProperty("java.io.tmpdir"));
        Path store = tmp.resolve("sandbox-gateway-trust-" + hex + ".p12");
        if (Files.isRegularFile(store)) {
            return store;
        }
        KeyStore keys = KeyStore.getInstance("PKCS12");
        keys.load(null, null);
        int i = 0;
        for (Certificate cert : CertificateFactory.getInstance("X.509")
                .generateCertificates(new ByteArrayInputStream(pem))) {
            keys.setCertificateEntry("bundle-" + i++, cert);
        }
        Path partial = Files.createTempFile(tmp, "sandbox-gateway-trust-", ".tmp");
        try (OutputStream out = Files.newOutputStream(partial)) {
            keys.store(out, "changeit".toCharArray());
        }
        Files.move(partial, store, StandardCopyOption.REPLACE_EXISTING, StandardCopyOption.ATOMIC_MOVE);
        return store;
    }

    private static String env(String upper, String lower) {
        String value = System.getenv(upper);
        return value != null && !value.isEmpty() ? value : System.getenv(lower);
    }

    private static void setDefault(String key, String value) {
        if (System.getProperty(key) == null) {
            System.setProperty(key, value);
        }
    }
}
