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
 * 127.0.0.1 that adds Proxy-Authorization (from HTTPS_PROXY's user:token) to every request
 * head the client sends the proxy, and points the proxy system properties at it: every
 * client that follows the JDK's proxy settings sends through it, without an authenticator.
 * A CONNECT is one head, then the tunnel's bytes are copied both ways (the gateway keeps
 * the tunnel's identity). A plain http:// connection carries one proxy request after
 * another (keep-alive), and the gateway wants the credentials on each (a request's
 * identity is its own, never inherited from an earlier request: docs/clients.md),
 * so the relay follows the requests' framing (Content-Length, chunked) to find each head;
 * after an Upgrade it copies bytes as they come.
 * Trust: a PKCS12 trust store written from SSL_CERT_FILE (the system bundle with the
 * gateway CA), set as javax.net.ssl.trustStore, which the JDK's default SSLContext and
 * clients that build their own from the JDK's trust manager both read. Properties that are
 * already set (-D on the command line) are left as they are.
 *
 * Build: make jvm-agent (javac --release 11; the jar is committed, package data).
 */
package io.sandboxgateway;

import java.io.BufferedInputStream;
import java.io.BufferedOutputStream;
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
    private static final long RAW = -1;  // a body length: copy the rest as it comes
    private static final long CHUNKED = -2;

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

    /** One client connection to the gateway: its request heads with the credentials. */
    private static void relay(Socket client, InetSocketAddress gateway, byte[] header) {
        try (client; Socket upstream = new Socket()) {
            client.setSoTimeout(IDLE_MS);
            InputStream in = new BufferedInputStream(client.getInputStream());
            byte[] first = readHead(in);
            if (first == null) {
                return;
            }
            upstream.connect(gateway, 30_000);
            upstream.setSoTimeout(IDLE_MS);
            OutputStream out = new BufferedOutputStream(upstream.getOutputStream());
            InputStream fromGateway = upstream.getInputStream();
            Thread back = new Thread(() -> copy(fromGateway, upstream, client),
                                     "sandbox-gateway-relay-back");
            back.setDaemon(true);
            back.start();
            requests(in, out, first, header, client, upstream);
            back.join(IDLE_MS);
        } catch (IOException | InterruptedException e) {
            // the connection ends; the client sees its socket close
        }
    }

    /**
     * The client's requests, each head with the credentials, each body copied by its
     * framing; a CONNECT, an Upgrade or a framing the relay cannot follow: the rest of the
     * connection copied as it comes (a head after that goes as sent, and without
     * credentials the gateway refuses it 407).
     */
    private static void requests(InputStream in, OutputStream out, byte[] first, byte[] header,
                                 Socket client, Socket upstream) throws IOException {
        byte[] head = first;
        while (head != null) {
            writeHead(out, head, header);
            out.flush();  // (a client that sent Expect: 100-continue waits for the answer)
            long length = bodyLength(head);
            if (length == RAW) {
                copy(in, client, upstream);
                return;
            }
            if (length == CHUNKED) {
                copyChunked(in, out);
            } else {
                copyExactly(in, out, length);
            }
            out.flush();
            head = readHead(in);
        }
        upstream.shutdownOutput();
    }

    /** The body's length by the head's framing; CHUNKED, or RAW (copy as it comes). */
    private static long bodyLength(byte[] head) {
        String text = new String(head, StandardCharsets.ISO_8859_1);
        if (text.regionMatches(true, 0, "CONNECT ", 0, 8)) {
            return RAW;
        }
        long length = 0;
        boolean chunked = false;
        for (String line : text.split("\r?\n")) {
            int colon = line.indexOf(':');
            if (colon <= 0) {
                continue;
            }
            String name = line.substring(0, colon).trim().toLowerCase(java.util.Locale.ROOT);
            String value = line.substring(colon + 1).trim().toLowerCase(java.util.Locale.ROOT);
            if (name.equals("upgrade")) {
                return RAW;
            } else if (name.equals("transfer-encoding")) {
                if (!value.endsWith("chunked")) {
                    return RAW;
                }
                chunked = true;
            } else if (name.equals("content-length")) {
                try {
                    length = Long.parseLong(value);
                } catch (NumberFormatException e) {
                    return RAW;
                }
                if (length < 0) {
                    return RAW;
                }
            }
        }
        return chunked ? CHUNKED : length;
    }

    /** The next request head (through its blank line); null at the connection's end. */
    private static byte[] readHead(InputStream in) throws IOException {
        ByteArrayOutputStream head = new ByteArrayOutputStream();
        while (true) {
            int b = in.read();
            if (b < 0 || head.size() >= MAX_HEAD) {
                return null;
            }
            if (head.size() == 0 && (b == '\r' || b == '\n')) {
                continue;  // (blank lines between requests, which RFC 9112 lets a server skip)
            }
            head.write(b);
            if (b == '\n' && endsWithBlankLine(head)) {
                return head.toByteArray();
            }
        }
    }

    private static void writeHead(OutputStream out, byte[] head, byte[] header) throws IOException {
        int firstLine = indexOf(head, (byte) '\n') + 1;
        out.write(head, 0, firstLine);
        if (!hasProxyAuthorization(head)) {
            out.write(header);
        }
        out.write(head, firstLine, head.length - firstLine);
    }

    private static void copyExactly(InputStream in, OutputStream out, long length) throws IOException {
        byte[] buffer = new byte[16384];
        long left = length;
        while (left > 0) {
            int n = in.read(buffer, 0, (int) Math.min(buffer.length, left));
            if (n < 0) {
                throw new IOException("the client ended inside a request body");
            }
            out.write(buffer, 0, n);
            out.flush();
            left -= n;
        }
    }

    /** A chunked body: each size line and its chunk, then the trailer through its blank line. */
    private static void copyChunked(InputStream in, OutputStream out) throws IOException {
        while (true) {
            String line = copyLine(in, out);
            int end = line.indexOf(';');
            long size;
            try {
                size = Long.parseLong((end < 0 ? line : line.substring(0, end)).trim(), 16);
            } catch (NumberFormatException e) {
                throw new IOException("a chunk size the relay cannot read");
            }
            if (size < 0) {
                throw new IOException("a chunk size the relay cannot read");
            }
            if (size == 0) {
                while (!copyLine(in, out).isEmpty()) {
                    // trailer fields, through the blank line
                }
                return;
            }
            copyExactly(in, out, size);
            copyLine(in, out);
        }
    }

    /** One line copied through its LF; its text without the line end. */
    private static String copyLine(InputStream in, OutputStream out) throws IOException {
        StringBuilder line = new StringBuilder();
        while (true) {
            int b = in.read();
            if (b < 0 || line.length() >= MAX_HEAD) {
                throw new IOException("the client ended inside a chunked body");
            }
            out.write(b);
            if (b == '\n') {
                int n = line.length();
                return n > 0 && line.charAt(n - 1) == '\r' ? line.substring(0, n - 1) : line.toString();
            }
            line.append((char) b);
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
